"""Device-side helpers shared by the varlen Triton attention kernels (GQA and MLA)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def find_sequence(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The sequence that owns program q_block when sequence i's query blocks start at
    query_start_loc[i] // BLOCK_Q + i (so no host sync is needed to build the grid): the last i
    with that start <= q_block, by binary search."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while lo < hi - 1:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_block <= q_block, mid, lo)
        hi = tl.where(first_block <= q_block, hi, mid)
    return lo


@triton.jit
def locate_query_block(query_start_loc_ptr, seq_lens_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """Program q_block's sequence and place in it: (seq, q_start, q_len, local_block, prefix_len).
    The caller returns when local_block * BLOCK_Q >= q_len (a surplus block of its sequence)."""
    seq = find_sequence(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    prefix_len = tl.load(seq_lens_ptr + seq) - q_len  # context before this step's first query token
    return seq, q_start, q_len, local_block, prefix_len


@triton.jit
def split_tile_range(prefix_len, q_len, local_block, split, num_splits, BLOCK_Q: tl.constexpr,
                     TILE_N: tl.constexpr):
    """(kv_end, tile_lo, tile_hi): the context a query block needs (up to its last query token)
    and this split's share of its TILE_N-token tiles (empty past the last tile)."""
    kv_end = prefix_len + tl.minimum(q_len, (local_block + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    return kv_end, tile_lo, tl.minimum(tile_lo + tiles_per_split, num_tiles)


@triton.jit
def online_softmax_step(scores, m_i, l_i):
    """One tile of base-2 online softmax: scores [M, N] (masked keys -inf) against the running max
    m_i and sum l_i [M] -> (probabilities [M, N], rescale of the old accumulator [M], new max,
    new sum). A row that sees no key yet (a later split's range, or padding) stays finite."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    prob = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return prob, alpha, m_new, l_i * alpha + tl.sum(prob, axis=1)


@triton.jit
def store_attention(acc, m_i, l_i, row_valid, out_mask, part_row, cols, out_ptr, out_offsets,
                    part_acc_ptr, part_max_ptr, part_sum_ptr, WIDTH: tl.constexpr, SPLIT: tl.constexpr):
    """A program's result: the normalised rows to out (not split), or the partial accumulator,
    max and sum at part_row for the merge kernel (split)."""
    if SPLIT:
        tl.store(part_max_ptr + part_row, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part_row, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part_row[:, None] * WIDTH + cols[None, :], acc, mask=out_mask)
    else:
        result = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def split_statistics(part_max_ptr, part_sum_ptr, row, num_splits, SPLITS_P: tl.constexpr):
    """A merge's view of one (token, head) row's splits: (running maxima m [SPLITS_P], their max,
    each split's weight exp2(m - max), the total softmax sum). Empty splits (-inf) weigh 0;
    the max is finite since split 0 always holds key 0."""
    splits = tl.arange(0, SPLITS_P)
    split_valid = splits < num_splits
    m = tl.load(part_max_ptr + row * num_splits + splits, mask=split_valid, other=float("-inf"))
    s = tl.load(part_sum_ptr + row * num_splits + splits, mask=split_valid, other=0.0)
    m_max = tl.max(m, axis=0)
    weight = tl.exp2(m - m_max)
    return m, m_max, weight, tl.sum(s * weight, axis=0)
