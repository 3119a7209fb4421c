"""The varlen attention kernel over the paged GQA cache (its KV write: triton_write_kv.py; the tile
sizes, context split and input checks its launcher shares with the other paged kernels:
triton_paged_launch.py).

Twin: `TorchAttentionBackend.attend` in reference.py holds the reference semantics;
tests/ops/test_attention_paged.py holds the two together on random inputs.

The attention kernel handles every kind of row in one launch: prefill chunks (with or without a
cached prefix), decode (1 query token) and verify (1 + k query tokens). Each program owns one
block of BLOCK_Q query tokens of one sequence and one kv head. The query heads that share that kv
head are packed with the query tokens into the M dimension of the tile (row m = token m // GROUP_P,
head m % GROUP_P), so K/V are read once per kv-head group and decode/verify still feed tensor
cores. The program walks the context in tiles of TILE_N tokens, gathering each token's block
through the block table (so TILE_N need not equal the cache block size), with an online softmax
in float32 (base 2, the scale folded in).

Sequences are found without a host sync: sequence i is given floor(qsl[i+1]/BLOCK_Q) -
floor(qsl[i]/BLOCK_Q) + 1 query blocks (at least the cdiv(q_len, BLOCK_Q) it needs), so the grid
is num_tokens // BLOCK_Q + num_seqs blocks and a program finds its sequence by binary search over
query_start_loc. Surplus blocks return at once. Grid sizes depend only on host ints (shapes and
max_query_len), so a launch is CUDA-graph capturable.

Long-context decode with few programs splits the context (flash-decoding): up to num_splits
programs cover pieces of at least MIN_SPLIT_TOKENS (triton_paged_launch.py) of their own context
(sized in-kernel from seq_lens, so the split adapts to the real length), and the last to finish
merges the pieces (triton_varlen.py says how).

Rows of `out` past query_start_loc[-1] (padding) are left untouched.

A draft tree's forward passes tree_mask [num_tokens, W] (bool, int8 or uint8): on top of the causal
limit, a row sees key seq_len - W + c of its sequence (column c: the last W keys, a verify's tree
rows or a drafter's frontier rows so far) only where its mask row is set (reference.py's
semantics). Without a mask the kernel is compiled without it (TREE_MASK off).

An FP8 cache (fp8_kv.py; triton_write_kv.py stores key / k_scale and value / v_scale in e4m3): the
attention converts each K/V tile to the query's dtype (exact) and runs its dots there, k_scale
folded into the softmax scale and v_scale applied to the float32 accumulator once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.attention.triton_varlen import (
    context_tile,
    locate_query_block,
    online_softmax_step,
    split_tile_range,
    store_attention,
)
from foretell.ops.attention.fp8_kv import check_scale, is_fp8
from foretell.ops.attention.triton_fp8_kv import check_fp8_query, compute_dtype, dot_precision
from foretell.ops.attention.triton_paged_launch import (
    MIN_SPLIT_TOKENS,
    check_paged_cache,
    choose_num_splits,
    paged_launch_config,
    tree_mask_rows,
    unit_last_stride,
)
from foretell.ops.common.pdl import join_dependent_chain, launch_options, pdl_enabled
from foretell.ops.common.split_counters import SplitCounters

_LOG2E = 1.4426950408889634


@triton.jit
def tree_visible(visible, tree_mask_ptr, token_index, stride_mask_token, row_valid, key_pos, key_valid,
                 mask_start, mask_width):
    """visible [M, TILE_N] narrowed by a tree's ancestor mask: key positions mask_start ..
    mask_start + mask_width - 1 (the sequence's last mask_width keys) are visible to row i only
    where its mask row (token_index [M]) says so; keys before them stay as they were."""
    column = key_pos - mask_start  # [TILE_N]: the key's mask column (< 0: before the mask)
    in_mask = (column >= 0) & (column < mask_width) & key_valid
    seen = tl.load(tree_mask_ptr + token_index[:, None] * stride_mask_token + column[None, :],
                   mask=row_valid[:, None] & in_mask[None, :], other=1)
    return visible & (seen != 0)


@triton.jit(do_not_specialize=["num_seqs", "stride_table_seq"])  # per-batch sizes: one compile
def _paged_attention_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    out_ptr,  # [num_tokens, num_heads, head_dim] (used when not split)
    part_acc_ptr,  # [num_tokens, num_heads, num_splits, head_dim] fp32 (used when split)
    part_max_ptr,  # [num_tokens, num_heads, num_splits] fp32, base-2 running max
    part_sum_ptr,  # [num_tokens, num_heads, num_splits] fp32
    counters_ptr,  # [num_q_blocks * num_kv_heads] int32, zero (used when split)
    block_table_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    tree_mask_ptr,  # [num_tokens, mask_width] int8 (used with TREE_MASK)
    mask_width,
    stride_mask_token,
    num_seqs,
    scale_log2,  # softmax scale * log2(e) (* k_scale for an FP8 cache)
    v_scale,  # FP8 caches: the accumulator's factor (unused otherwise)
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_P: tl.constexpr,  # next power of two of GROUP
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_P rows
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size
    TILE_N: tl.constexpr,  # context tokens per inner step
    SPLIT: tl.constexpr,  # several programs per query block and kv head share the context
    MIN_TILES: tl.constexpr,  # fewest tiles per split
    DOT_PRECISION: tl.constexpr,
    FP8_CACHE: tl.constexpr,  # e4m3 tiles, converted to the query's dtype on load
    PDL: tl.constexpr,  # launched with programmatic dependent launch (ops/common/pdl.py)
    TREE_MASK: tl.constexpr,  # rows see, of the sequence's last mask_width keys, only those their tree_mask row marks
):
    join_dependent_chain(PDL)  # the next kernel (the o projection's GEMV) streams weights meanwhile
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq, q_start, q_len, local_block, prefix_len = locate_query_block(
        query_start_loc_ptr, seq_lens_ptr, num_seqs, q_block, BLOCK_Q
    )
    if local_block * BLOCK_Q >= q_len:
        return

    rows = tl.arange(0, BLOCK_M)
    row_token = local_block * BLOCK_Q + rows // GROUP_P  # token index within the sequence
    row_head = rows % GROUP_P
    row_valid = (row_token < q_len) & (row_head < GROUP)
    row_pos = prefix_len + row_token  # causal limit: keys 0..row_pos
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < HEAD_DIM

    head = kv_head * GROUP + row_head
    token_index = (q_start + row_token).to(tl.int64)
    q_offsets = (
        token_index[:, None] * stride_q_token
        + head[:, None] * stride_q_head
        + dims[None, :]
    )
    kv_end, tile_lo, tile_hi, active = split_tile_range(
        prefix_len, q_len, local_block, split, num_splits, BLOCK_Q, TILE_N, MIN_TILES
    )
    if split >= active:
        return
    q = tl.load(query_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if not FP8_CACHE:
        q = q.to(k_cache_ptr.dtype.element_ty)  # tl.dot wants matching operand types

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_table_seq
    head_offset = kv_head.to(tl.int64) * stride_cache_head
    for tile in range(tile_lo, tile_hi):
        key_pos, key_valid, token_offsets = context_tile(table_row, tile, kv_end, stride_cache_block,
                                                         stride_cache_slot, BLOCK_SIZE, TILE_N)
        token_offsets += head_offset
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + token_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + token_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if FP8_CACHE:
            k, v = k.to(q.dtype), v.to(q.dtype)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = (key_pos[None, :] <= row_pos[:, None]) & key_valid[None, :]
        if TREE_MASK:
            visible = tree_visible(visible, tree_mask_ptr, token_index, stride_mask_token, row_valid, key_pos,
                                   key_valid, prefix_len + q_len - mask_width, mask_width)
        scores = tl.where(visible, scores, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(scores, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    if FP8_CACHE:
        acc = acc * v_scale  # every split alike, so merged partials carry it once

    part_base = (token_index * (GROUP * tl.num_programs(1)) + head) * num_splits
    out_offsets = token_index[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :]
    counter_ptr = counters_ptr + q_block * tl.num_programs(1) + kv_head
    store_attention(acc, m_i, l_i, row_valid, row_valid[:, None] & dim_valid[None, :], part_base, split,
                    active, counter_ptr, dims, out_ptr, out_offsets, part_acc_ptr, part_max_ptr,
                    part_sum_ptr, BLOCK_M, HEAD_DIM_P, HEAD_DIM, SPLIT, True)


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length after this step's writes
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written in place
    num_splits: int | None = None,  # None: chosen from shapes; 1 disables the split
    min_split_tokens: int = MIN_SPLIT_TOKENS,  # fewest context tokens per split (benchmarks sweep it)
    counters: SplitCounters | None = None,  # the caller's persistent counters; None: zeros per call
    k_scale: float = 1.0,  # FP8 caches: a stored key stands for key * k_scale
    v_scale: float = 1.0,
    launch_query_len: int | None = None,  # the query length tiles are sized for; None: max_query_len
    tree_mask: torch.Tensor | None = None,  # [num_tokens, W] bool/int8/uint8 over each sequence's last W keys
) -> torch.Tensor:
    """Causal varlen attention of each sequence's queries to its paged context; returns `out`.
    With num_splits=1 and a constant launch_query_len a row's result depends on its own query and
    context only (the batch-invariant mode: triton_batch_invariant.py)."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    check_paged_cache(kv_cache)
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query [{num_tokens}, {num_heads}, {head_dim}] does not fit a cache of "
            f"{num_kv_heads} kv heads x head_dim {cache_head_dim}"
        )
    if out.stride(-1) != 1:
        raise ValueError("paged_attention_triton needs `out` with a unit stride on head_dim")
    if num_tokens == 0 or num_seqs == 0:
        return out
    query = unit_last_stride(query)
    check_fp8_query(kv_cache, query.dtype)
    mask_rows = tree_mask_rows(tree_mask, num_tokens)
    fp8 = is_fp8(kv_cache.dtype)
    tiles = compute_dtype(kv_cache, query.dtype)
    group = num_heads // num_kv_heads
    launch_rows = max_query_len if launch_query_len is None else launch_query_len
    config = paged_launch_config(group, head_dim, launch_rows, tiles)
    block_q, block_m, tile_n = config["BLOCK_Q"], config["BLOCK_M"], config["TILE_N"]
    if num_splits is None:
        num_splits = choose_num_splits(
            query.device,
            active_programs=num_seqs * triton.cdiv(max(max_query_len, 1), block_q) * num_kv_heads,
            max_context=block_table.shape[1] * block_size,
            max_query_len=max_query_len,
            tile_n=tile_n,
        )
    num_q_blocks = num_tokens // block_q + num_seqs
    split = num_splits > 1
    pdl = pdl_enabled(query)
    if split:
        part_acc = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_max = torch.empty(
            (num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        part_sum = torch.empty_like(part_max)
        count = num_q_blocks * num_kv_heads
        if counters is None:  # a memset per call (also inside a graph); the backend keeps its own
            counter_buf = torch.zeros(count, dtype=torch.int32, device=query.device)
        else:
            counter_buf = counters.get(query.device, count)
    else:
        part_acc = part_max = part_sum = counter_buf = out  # unused by the kernel when not split
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        out,
        part_acc,
        part_max,
        part_sum,
        counter_buf,
        block_table,
        seq_lens,
        query_start_loc,
        out if mask_rows is None else mask_rows,  # unread without TREE_MASK
        0 if mask_rows is None else mask_rows.shape[1],
        0 if mask_rows is None else mask_rows.stride(0),
        num_seqs,
        scale * _LOG2E * (check_scale("k_scale", k_scale) if fp8 else 1.0),
        check_scale("v_scale", v_scale) if fp8 else 1.0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        GROUP=group,
        GROUP_P=triton.next_power_of_2(group),
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),  # tl.dot needs K >= 16
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        SPLIT=split,
        MIN_TILES=triton.cdiv(min_split_tokens, tile_n),
        DOT_PRECISION=dot_precision(tiles),
        FP8_CACHE=fp8,
        PDL=pdl,
        TREE_MASK=mask_rows is not None,
        num_warps=config["num_warps"],
        **launch_options(pdl),
    )
    return out
