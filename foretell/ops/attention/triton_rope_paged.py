"""Decode and verify attention with RoPE and the KV write in the same launch.

At batch 1 a decoder layer's attention is two short launches in a chain of dependent kernels:
RoPE + KV write (triton_rope_kv.py), then the paged attention (triton_paged.py). Each costs a
kernel boundary more than its work (the H200 times: docs/perf-log.md). Here the
attention's programs do the first one's work themselves:
  - the rotation of the queries: each program rotates (after Qwen3's q_norm) the query rows it
    attends with, in registers, and keeps them as their two rotary halves; a score is the sum of
    the halves' two products against the keys read the same way (a head's channels in any order
    give the same dot product);
  - the write of this step's keys and values: a program first writes, for its kv head, the new
    tokens that fall in its own share of the context (rotated, after k_norm), then waits for its
    threads (a block barrier makes the writes visible to the block) and attends as usual. Tokens
    in another split's share are that program's to write; none is read before its writer wrote it.
The second needs each sequence's queries in one query block (decode, and verify of up to 16
tokens: `fits`); a longer chunk (prefill) has blocks reading keys another block writes, and runs
the two launches. Partial rotary (rotary_dim < head_dim) also runs them.

Rounding follows the two-launch path: q and k are rotated by pointwise/triton_kernels.rotate_pairs (and
normed by rms_norm_heads), so the cache holds the same values (bit for bit in Triton's
interpreter; on a GPU the compiler may fuse a product with its sum in one kernel and not the
other: within a rounding); the scores' sums run in another order (two products of half width), so
outputs agree within float32 rounding. Twin:
rope_write_kv_triton then paged_attention_triton (and through them the torch path);
tests/ops/test_attention_rope_paged.py holds them together in Triton's interpreter.

A draft tree's forward (a tree verify of up to 16 nodes, a drafter's frontier rows) passes
tree_mask [num_tokens, W] with triton_paged.py's semantics: on top of the causal limit, a row sees
key seq_len - W + c of its sequence only where its mask row's column c is set (all-true rows: plain
causal rows). Without a mask the kernel is compiled without it (TREE_MASK off).

An FP8 cache (fp8_kv.py): the new keys and values go in as key / k_scale and value / v_scale in
e4m3 (rounded to the query's dtype first, as the two launches round them), the tiles read back are
converted to the query's dtype, k_scale rides in the softmax scale and v_scale multiplies the
float32 accumulator at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.attention.triton_paged import _LOG2E, tree_visible
from foretell.ops.attention.triton_paged_launch import (
    MIN_SPLIT_TOKENS,
    check_paged_cache,
    choose_num_splits,
    paged_launch_config,
    tree_mask_rows,
)
from foretell.ops.attention.triton_varlen import (
    context_tile,
    online_softmax_step,
    split_tile_range,
    store_attention,
)
from foretell.ops.attention.fp8_kv import check_scale, is_fp8
from foretell.ops.attention.triton_fp8_kv import check_fp8_query, compute_dtype, dot_precision, to_cache
from foretell.ops.common.pdl import join_dependent_chain, launch_options, pdl_enabled
from foretell.ops.common.split_counters import SplitCounters
from foretell.ops.common.protocols import NormModule
from foretell.ops.pointwise.triton_kernels import _in_dtype, rms_norm_heads, rotate_pairs

# Launch shape at batch 1, from 32 launches in a PDL chain on the H200 at Llama-8B heads (docs/
# perf-log.md, 2026-11-30, "The attention in a chain of launches"): idle splits still launch and
# wait, and the last program merges every piece that holds keys one after another, so more pieces
# cost more than they save; 16 keep long contexts fast. 16-bit tiles take 8 warps; float32 keeps
# paged_launch_config's (its tiles spill).
MAX_SPLITS = 16
WARPS_16_BIT = 8


@triton.jit
def _rotated_halves(
    x_ptr,  # [tokens, heads, head_dim] (any token and head strides)
    row_offsets,  # [R] int64: each row's (token, head) offset into x
    row_mask,  # [R]
    position,  # [R] int64
    cos_ptr,
    sin_ptr,
    stride_cos,
    norm_w_ptr,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_NORM: tl.constexpr,
    dtype: tl.constexpr,
):
    """Rows of heads (normed when HAS_NORM, then rotated at their positions), as their two rotary
    halves [R, HALF_P] in float32 rounded to dtype; padding lanes and masked rows hold 0."""
    halves = tl.arange(0, HALF_P)
    mask = row_mask[:, None] & (halves < HALF)[None, :]
    first, second = _pair_channels(halves, HALF, INTERLEAVED)
    x1 = tl.load(x_ptr + row_offsets[:, None] + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + row_offsets[:, None] + second[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # full rotary only: no channels past the pairs
        w1 = tl.load(norm_w_ptr + first, mask=halves < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(norm_w_ptr + second, mask=halves < HALF, other=0.0).to(tl.float32)[None, :]
        none = tl.zeros([1, 2], tl.float32)
        x1, x2, _ = rms_norm_heads(x1, x2, none, w1, w2, none, eps, HEAD_DIM, dtype)
    angle = position[:, None] * stride_cos + halves[None, :]
    cos = _in_dtype(tl.load(cos_ptr + angle, mask=mask, other=0.0), dtype)
    sin = _in_dtype(tl.load(sin_ptr + angle, mask=mask, other=0.0), dtype)
    o1, o2 = rotate_pairs(x1, x2, cos, sin, dtype)
    return _in_dtype(o1, dtype), _in_dtype(o2, dtype)


@triton.jit
def _pair_channels(halves, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The channels of each rotary pair: (2i, 2i + 1) for gptj, (i, i + HALF) for neox."""
    if INTERLEAVED:
        return 2 * halves, 2 * halves + 1
    return halves, HALF + halves


@triton.jit(do_not_specialize=["stride_table_seq"])  # the block table's width varies per batch
def _rope_paged_attention_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim], before RoPE
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], before RoPE
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    positions_ptr,  # [num_tokens] int
    cos_ptr,  # [max_positions, HALF] float32
    sin_ptr,
    slot_mapping_ptr,  # [num_tokens] int64; -1: padding (writes nothing)
    q_norm_ptr,  # [HEAD_DIM] (read when HAS_NORM)
    k_norm_ptr,
    q_eps,
    k_eps,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # [num_tokens, num_heads, num_splits, head_dim] fp32 (used when split)
    part_max_ptr,  # [num_tokens, num_heads, num_splits] fp32
    part_sum_ptr,
    counters_ptr,  # [num_seqs * num_kv_heads] int32, zero (used when split)
    block_table_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    tree_mask_ptr,  # [num_tokens, mask_width] int8 (read with TREE_MASK)
    mask_width,
    stride_mask_token,
    scale_log2,  # softmax scale * log2(e) (* k_scale for an FP8 cache)
    k_inv_scale,  # FP8 caches: 1 / k_scale, 1 / v_scale and v_scale (unused otherwise)
    v_inv_scale,
    v_scale,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cos,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # >= every sequence's query length: one query block per sequence
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    HALF_P: tl.constexpr,  # >= 16 (tl.dot)
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    MIN_TILES: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_CACHE: tl.constexpr,  # e4m3 cache: scaled on write, tiles converted to the query's dtype on read
    PDL: tl.constexpr,
    TREE_MASK: tl.constexpr,  # rows see, of the sequence's last mask_width keys, only those their tree_mask row marks
):
    join_dependent_chain(PDL)  # the o projection's GEMV streams weights meanwhile
    seq = tl.program_id(0)  # one query block per sequence
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    prefix_len = tl.load(seq_lens_ptr + seq) - q_len  # context before this step's first query token
    if q_len == 0:
        return
    kv_end, tile_lo, tile_hi, active = split_tile_range(
        prefix_len, q_len, 0, split, num_splits, BLOCK_Q, TILE_N, MIN_TILES
    )
    if split >= active:
        return
    dtype = query_ptr.dtype.element_ty  # the cache's too, unless the cache is FP8
    cache_dtype = k_cache_ptr.dtype.element_ty
    halves = tl.arange(0, HALF_P)
    first, second = _pair_channels(halves, HALF, INTERLEAVED)
    dims = tl.arange(0, HEAD_DIM_P)
    head_offset = kv_head.to(tl.int64) * stride_cache_head

    # This step's keys and values in this split's tiles: rotated into the cache first.
    tokens = tl.arange(0, BLOCK_Q)
    token_index = (q_start + tokens).to(tl.int64)
    token_tile = (prefix_len + tokens) // TILE_N
    slot = tl.load(slot_mapping_ptr + token_index, mask=tokens < q_len, other=-1)
    mine = (tokens < q_len) & (token_tile >= tile_lo) & (token_tile < tile_hi) & (slot >= 0)
    position = tl.load(positions_ptr + token_index, mask=mine, other=0).to(tl.int64)
    new_k1, new_k2 = _rotated_halves(key_ptr, token_index * stride_k_token + kv_head * stride_k_head, mine,
                                     position, cos_ptr, sin_ptr, stride_cos, k_norm_ptr, k_eps, HEAD_DIM, HALF,
                                     HALF_P, INTERLEAVED, HAS_NORM, dtype)
    slot_offset = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot + head_offset
    half_mask = mine[:, None] & (halves < HALF)[None, :]
    tl.store(k_cache_ptr + slot_offset[:, None] + first[None, :], to_cache(new_k1.to(dtype), k_inv_scale, cache_dtype),
             mask=half_mask)
    tl.store(k_cache_ptr + slot_offset[:, None] + second[None, :], to_cache(new_k2.to(dtype), k_inv_scale, cache_dtype),
             mask=half_mask)
    value_mask = mine[:, None] & (dims < HEAD_DIM)[None, :]
    new_v = tl.load(value_ptr + (token_index * stride_v_token + kv_head * stride_v_head)[:, None] + dims[None, :],
                    mask=value_mask)
    tl.store(v_cache_ptr + slot_offset[:, None] + dims[None, :], to_cache(new_v, v_inv_scale, cache_dtype),
             mask=value_mask)
    tl.debug_barrier()  # the block's writes are visible to the block's reads below

    # The query rows (token, head of the group), rotated the same way.
    rows = tl.arange(0, BLOCK_M)
    row_token = rows // GROUP_P
    row_head = rows % GROUP_P
    row_valid = (row_token < q_len) & (row_head < GROUP)
    row_pos = prefix_len + row_token  # causal limit: keys 0..row_pos
    head = kv_head * GROUP + row_head
    row_index = (q_start + row_token).to(tl.int64)
    row_position = tl.load(positions_ptr + row_index, mask=row_valid, other=0).to(tl.int64)
    q1, q2 = _rotated_halves(query_ptr, row_index * stride_q_token + head * stride_q_head, row_valid, row_position,
                             cos_ptr, sin_ptr, stride_cos, q_norm_ptr, q_eps, HEAD_DIM, HALF, HALF_P,
                             INTERLEAVED, HAS_NORM, dtype)
    q1, q2 = q1.to(dtype), q2.to(dtype)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_table_seq
    for tile in range(tile_lo, tile_hi):
        key_pos, key_valid, key_offsets = context_tile(table_row, tile, kv_end, stride_cache_block, stride_cache_slot,
                                                       BLOCK_SIZE, TILE_N)
        key_offsets += head_offset
        pair_mask = key_valid[:, None] & (halves < HALF)[None, :]
        k1 = tl.load(k_cache_ptr + key_offsets[:, None] + first[None, :], mask=pair_mask, other=0.0)
        k2 = tl.load(k_cache_ptr + key_offsets[:, None] + second[None, :], mask=pair_mask, other=0.0)
        v = tl.load(v_cache_ptr + key_offsets[:, None] + dims[None, :],
                    mask=key_valid[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
        if FP8_CACHE:
            k1, k2, v = k1.to(dtype), k2.to(dtype), v.to(dtype)
        scores = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
        scores += tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION)
        visible = (key_pos[None, :] <= row_pos[:, None]) & key_valid[None, :]
        if TREE_MASK:
            visible = tree_visible(visible, tree_mask_ptr, row_index, stride_mask_token, row_valid, key_pos,
                                   key_valid, prefix_len + q_len - mask_width, mask_width)
        scores = tl.where(visible, scores * scale_log2, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(scores, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    if FP8_CACHE:
        acc = acc * v_scale

    part_base = (row_index * (GROUP * tl.num_programs(1)) + head) * num_splits
    out_offsets = row_index[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :]
    counter_ptr = counters_ptr + seq * tl.num_programs(1) + kv_head
    store_attention(acc, m_i, l_i, row_valid, row_valid[:, None] & (dims < HEAD_DIM)[None, :], part_base, split,
                    active, counter_ptr, dims, out_ptr, out_offsets, part_acc_ptr, part_max_ptr,
                    part_sum_ptr, BLOCK_M, HEAD_DIM_P, HEAD_DIM, SPLIT, True)


def _query_block(query: torch.Tensor, max_query_len: int, kv_cache: torch.Tensor) -> int:
    """Query tokens per program (the paged attention's tile), at most 16."""
    group = query.shape[1] // kv_cache.shape[3]
    tiles = compute_dtype(kv_cache, query.dtype)
    return min(16, paged_launch_config(group, query.shape[2], max_query_len, tiles)["BLOCK_Q"])


def fits(query: torch.Tensor, max_query_len: int, rotary_dim: int, kv_cache: torch.Tensor) -> bool:
    """Whether one launch can serve this batch: every sequence's queries in one query block (decode,
    short verify), full rotary, and the cache in the query's dtype or FP8 (else: the two launches)."""
    return (1 <= max_query_len <= _query_block(query, max_query_len, kv_cache) and rotary_dim == query.shape[2]
            and (kv_cache.dtype == query.dtype or is_fp8(kv_cache.dtype)) and query.shape[1] % kv_cache.shape[3] == 0)


def rope_paged_attention_triton(
    positions: torch.Tensor,  # [num_tokens] int
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], before RoPE
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], before RoPE
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_cache: torch.Tensor,  # [max_positions, head_dim // 2] float32
    sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], query's dtype or e4m3
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1: padding
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length after this step's writes
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    scale: float,
    style: str = "neox",
    qk_norm: tuple[NormModule, NormModule] | None = None,  # (q_norm, k_norm) per head, before RoPE
    counters: SplitCounters | None = None,  # the caller's persistent counters; None: zeros per call
    num_splits: int | None = None,  # None: chosen from shapes, as paged_attention_triton does
    min_split_tokens: int = MIN_SPLIT_TOKENS,
    k_scale: float = 1.0,  # FP8 caches: stored key = key / k_scale, read back as stored * k_scale
    v_scale: float = 1.0,
    tree_mask: torch.Tensor | None = None,  # [num_tokens, W] bool/int8/uint8 over each sequence's last W keys
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """rope_write_kv_triton then paged_attention_triton (with the same tree_mask), in one launch
    (a batch that `fits`)."""
    num_tokens, num_heads, head_dim = query.shape
    check_paged_cache(kv_cache)
    num_kv_heads = kv_cache.shape[3]
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"key and value must be [{num_tokens}, {num_kv_heads}, {head_dim}] for query "
                         f"{list(query.shape)} and this cache, got {list(key.shape)} and {list(value.shape)}")
    if not fits(query, max_query_len, 2 * cos_cache.shape[1], kv_cache):
        raise ValueError(
            f"one-launch RoPE + attention needs each sequence's queries in one block of "
            f"{_query_block(query, max_query_len, kv_cache)} tokens (max_query_len {max_query_len}), full rotary "
            f"(rotary_dim {2 * cos_cache.shape[1]}, head_dim {head_dim}), {num_heads} heads a multiple of "
            f"{num_kv_heads} kv heads and the cache in the query's dtype or FP8 ({kv_cache.dtype}, {query.dtype}); "
            "run rope_write_kv_triton and paged_attention_triton instead")
    if style not in ("neox", "gptj"):
        raise ValueError(f"rope style {style!r} is not one of neox, gptj")
    mask_rows = tree_mask_rows(tree_mask, num_tokens)  # int8 view, or None: compiled without TREE_MASK
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    check_fp8_query(kv_cache, query.dtype)
    fp8 = is_fp8(kv_cache.dtype)
    tiles = compute_dtype(kv_cache, query.dtype)
    k_scale = check_scale("k_scale", k_scale) if fp8 else 1.0
    v_scale = check_scale("v_scale", v_scale) if fp8 else 1.0
    group = num_heads // num_kv_heads
    block_size = kv_cache.shape[2]
    config = paged_launch_config(group, head_dim, max_query_len, tiles)
    if num_splits is None:
        num_splits = choose_num_splits(query.device, active_programs=num_seqs * num_kv_heads,
                                        max_context=block_table.shape[1] * block_size,
                                        max_query_len=max_query_len, tile_n=config["TILE_N"],
                                        max_splits=MAX_SPLITS)
    split = num_splits > 1
    if split:
        part_acc = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
        part_max = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
        count = num_seqs * num_kv_heads
        counter_buf = (torch.zeros(count, dtype=torch.int32, device=query.device) if counters is None
                       else counters.get(query.device, count))
    else:
        part_acc = part_max = part_sum = counter_buf = out  # unused by the kernel when not split
    q_norm, k_norm = qk_norm if qk_norm is not None else (None, None)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    cos_cache, sin_cache = cos_cache.contiguous(), sin_cache.contiguous()
    pdl = pdl_enabled(query)
    _rope_paged_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, key, value, positions.contiguous(), cos_cache, sin_cache, slot_mapping,
        q_norm.weight if q_norm is not None else query, k_norm.weight if k_norm is not None else key,
        q_norm.eps if q_norm is not None else 0.0, k_norm.eps if k_norm is not None else 0.0,
        k_cache, v_cache, out, part_acc, part_max, part_sum, counter_buf, block_table, seq_lens, query_start_loc,
        out if mask_rows is None else mask_rows,  # unread without TREE_MASK
        0 if mask_rows is None else mask_rows.shape[1], 0 if mask_rows is None else mask_rows.stride(0),
        scale * _LOG2E * k_scale, 1.0 / k_scale, 1.0 / v_scale, v_scale,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cos_cache.stride(0), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        GROUP=group,
        GROUP_P=triton.next_power_of_2(group),
        BLOCK_Q=config["BLOCK_Q"],
        BLOCK_M=config["BLOCK_M"],
        HEAD_DIM=head_dim,
        HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),
        HALF=head_dim // 2,
        HALF_P=max(16, triton.next_power_of_2(head_dim // 2)),
        BLOCK_SIZE=block_size,
        TILE_N=config["TILE_N"],
        SPLIT=split,
        MIN_TILES=triton.cdiv(min_split_tokens, config["TILE_N"]),
        INTERLEAVED=style == "gptj",
        HAS_NORM=qk_norm is not None,
        DOT_PRECISION=dot_precision(tiles),
        FP8_CACHE=fp8,
        PDL=pdl,
        TREE_MASK=mask_rows is not None,
        num_warps=WARPS_16_BIT if tiles.itemsize == 2 else config["num_warps"],
        **launch_options(pdl),
    )
    return out
