"""Helpers shared by the varlen Triton attention kernels (GQA and MLA): finding a program's
sequence, the online softmax, and the split of a long context (flash-decoding).

Split context: a decode or verify launch with few programs gives each (query block, head group)
`num_splits` programs (a number fixed by shapes, so a CUDA graph holds for any context length).
At run time the context is cut into pieces of at least MIN_TILES tiles, so a short context uses
one or a few of them and the rest return at once. A lone piece writes the output directly; else
each writes an unnormalised partial (accumulator, running max, sum), and the LAST program of the
group to finish (counted with an atomic per group in `SplitCounters`, ops/common/split_counters.py) merges the partials and
resets its counter: no merge launch per layer. That merge is serial over the pieces, so wide rows
(MLA's 512-wide latent: slower on the H200 than a merge kernel, docs/perf-log.md) keep
a merge kernel instead (MERGE_IN_KERNEL off: every split program writes a partial, the merge
kernel reads them through `split_statistics`).
"""

from __future__ import annotations

import torch
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
                     TILE_N: tl.constexpr, MIN_TILES: tl.constexpr):
    """(kv_end, tile_lo, tile_hi, active): the context a query block needs (up to its last query
    token), this split's share of its TILE_N-token tiles (empty past the last tile), and how many
    splits hold tiles (pieces of at least MIN_TILES tiles, so short contexts use few)."""
    kv_end = prefix_len + tl.minimum(q_len, (local_block + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), MIN_TILES)
    tile_lo = split * tiles_per_split
    return kv_end, tile_lo, tl.minimum(tile_lo + tiles_per_split, num_tiles), tl.cdiv(num_tiles, tiles_per_split)


@triton.jit
def context_tile(table_row, tile, kv_end, stride_cache_block, stride_cache_slot,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """A sequence's keys tile * TILE_N onwards in the paged cache, table_row its block-table row:
    (positions [TILE_N], valid = before kv_end [TILE_N], each key's slot offset [TILE_N] int64)."""
    key_pos = tile * TILE_N + tl.arange(0, TILE_N)
    key_valid = key_pos < kv_end
    block_ids = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
    return key_pos, key_valid, block_ids.to(tl.int64) * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_slot


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
def _store_normalised(acc, l_i, out_mask, out_ptr, out_offsets):
    result = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _store_partial(acc, m_i, l_i, row, row_valid, out_mask, cols, part_acc_ptr, part_max_ptr, part_sum_ptr,
                   WIDTH: tl.constexpr):
    tl.store(part_max_ptr + row, m_i, mask=row_valid)
    tl.store(part_sum_ptr + row, l_i, mask=row_valid)
    tl.store(part_acc_ptr + row[:, None] * WIDTH + cols[None, :], acc, mask=out_mask)


@triton.jit
def _merge_partials(part_base, active, row_valid, out_mask, cols, part_acc_ptr, part_max_ptr,
                    part_sum_ptr, BLOCK_M: tl.constexpr, WIDTH_P: tl.constexpr, WIDTH: tl.constexpr):
    """(acc [BLOCK_M, WIDTH_P], sum [BLOCK_M]) of the rows' `active` partials, merged in split
    order with the same rescaling as the online softmax. Loads bypass L1 (.cg): other programs
    wrote them during this launch."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, WIDTH_P], dtype=tl.float32)
    for s in range(0, active):
        row = part_base + s
        m_s = tl.load(part_max_ptr + row, mask=row_valid, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(part_sum_ptr + row, mask=row_valid, other=0.0, cache_modifier=".cg")
        acc_s = tl.load(part_acc_ptr + row[:, None] * WIDTH + cols[None, :], mask=out_mask, other=0.0,
                        cache_modifier=".cg")
        m_new = tl.maximum(m_i, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        beta = tl.exp2(m_s - m_safe)
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        l_i = l_i * alpha + l_s * beta
        m_i = m_new
    return acc, l_i


@triton.jit
def store_attention(acc, m_i, l_i, row_valid, out_mask, part_base, split, active, counter_ptr, cols,
                    out_ptr, out_offsets, part_acc_ptr, part_max_ptr, part_sum_ptr,
                    BLOCK_M: tl.constexpr, WIDTH_P: tl.constexpr, WIDTH: tl.constexpr,
                    SPLIT: tl.constexpr, MERGE_IN_KERNEL: tl.constexpr):
    """A program's result. Unsplit, or the only split holding tiles: the normalised rows to out.
    Else the partial at part_base + split ([BLOCK_M] row offsets into the partial buffers); the
    group's last program to arrive at counter_ptr merges all `active` partials into out. Without
    MERGE_IN_KERNEL every split writes its partial (empty ones too: max -inf, sum 0) for a merge
    kernel launched after."""
    if SPLIT:  # one constexpr per test, so the branch not taken is never compiled
        if MERGE_IN_KERNEL:
            if active > 1:
                _store_partial(acc, m_i, l_i, part_base + split, row_valid, out_mask, cols, part_acc_ptr,
                               part_max_ptr, part_sum_ptr, WIDTH)
                tl.debug_barrier()  # every thread's partial is written before the release below
                arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
                if arrived == active - 1:
                    merged, total = _merge_partials(part_base, active, row_valid, out_mask, cols, part_acc_ptr,
                                                    part_max_ptr, part_sum_ptr, BLOCK_M, WIDTH_P, WIDTH)
                    _store_normalised(merged, total, out_mask, out_ptr, out_offsets)
                    tl.atomic_xchg(counter_ptr, 0)  # ready for the next launch
            else:
                _store_normalised(acc, l_i, out_mask, out_ptr, out_offsets)
        else:
            _store_partial(acc, m_i, l_i, part_base + split, row_valid, out_mask, cols, part_acc_ptr,
                           part_max_ptr, part_sum_ptr, WIDTH)
    else:
        _store_normalised(acc, l_i, out_mask, out_ptr, out_offsets)


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
