"""Triton MLA attention over the latent cache: one varlen attention kernel in the absorbed form and
the kernel that merges its context splits (the latent cache writes: triton_latent_write.py;
`TritonMLABackend`, graph safe, puts them behind the MLA backend interface: triton_backend.py).

Twin: `absorbed_attention` in reference.py holds the reference semantics; tests/ops/test_mla_attention.py
holds kernels and twins together on random inputs (Triton's interpreter on the CPU),
tests/gpu/test_mla_moe_gpu.py does it on CUDA in bf16.

The attention works on q = [q_lat | q_pe] (kv_lora_rank + rope wide) against the cached
[c | k_pe] of each context token: one key "head" shared by every query head (MQA), with the latent
c doubling as the value. So each program packs BLOCK_Q query tokens x BLOCK_H query heads into the
M dimension of its tiles (row m = token m // BLOCK_H, head m % BLOCK_H) and reads each latent
tile once for all of them: scores = q_lat c^T + q_pe k_pe^T, o_lat += p c. Online softmax in
float32, base 2, the scale folded in. Causal per query row: row j of a sequence with q_len queries
and context seq_len sits at seq_len - q_len + j.

Sequences are found without a host sync, as in the GQA kernel (ops/attention/triton_paged.py):
sequence i gets floor(qsl[i+1]/BLOCK_Q) - floor(qsl[i]/BLOCK_Q) + 1 query blocks, found by
binary search over query_start_loc; surplus blocks return. Decode and verify with few programs
split the context (flash-decoding) and merge the partial results in a second kernel (the GQA
kernel merges inside; a 512-wide latent row made that serial merge slower than a launch). Grids
depend only on shapes and max_query_len, so every launch can be captured in a CUDA graph.
The same kernel serves prefill chunks (any query length), so the backend never reads host
lengths. Rows of the output past query_start_loc[-1] are left untouched.

An FP8 latent cache (ops/attention/fp8_kv.py, one k_scale per layer): writes store the entry /
k_scale in e4m3 (triton_latent_write.py); the attention converts each latent tile to the query's
dtype (exact), k_scale rides in the softmax scale (scores) and multiplies the float32 accumulator
(c is the value too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.attention.fp8_kv import check_scale, is_fp8
from foretell.ops.attention.triton_fp8_kv import check_fp8_query, compute_dtype, dot_precision
from foretell.ops.attention.triton_paged_launch import (
    choose_num_splits,
    unit_last_stride,
)
from foretell.ops.attention.triton_varlen import (
    context_tile,
    locate_query_block,
    online_softmax_step,
    split_statistics,
    split_tile_range,
    store_attention,
)
from foretell.ops.mla.triton_latent_write import check_latent_cache

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_seqs", "stride_table_seq"])  # per-batch sizes: one compile
def _mla_attention_kernel(
    q_lat_ptr,  # [num_tokens, num_heads, rank]
    q_pe_ptr,  # [num_tokens, num_heads, rope]
    cache_ptr,  # [num_blocks, block_size, rank + rope]
    out_ptr,  # [num_tokens, num_heads, rank] (used when not split)
    part_acc_ptr,  # [num_tokens, num_heads, num_splits, rank] fp32 (used when split)
    part_max_ptr,  # [num_tokens, num_heads, num_splits] fp32, base-2 running max
    part_sum_ptr,  # [num_tokens, num_heads, num_splits] fp32
    block_table_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    num_seqs,
    scale_log2,  # softmax scale * log2(e) (* k_scale for an FP8 cache)
    k_scale,  # FP8 caches: the accumulator's factor (unused otherwise)
    stride_lat_token,
    stride_lat_head,
    stride_pe_token,
    stride_pe_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_table_seq,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # query heads per program (a power of two)
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # BLOCK_Q * BLOCK_H rows
    RANK: tl.constexpr,
    RANK_P: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size
    TILE_N: tl.constexpr,  # context tokens per inner step
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_CACHE: tl.constexpr,  # e4m3 tiles, converted to the query's dtype on load
):
    q_block = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq, q_start, q_len, local_block, prefix_len = locate_query_block(
        query_start_loc_ptr, seq_lens_ptr, num_seqs, q_block, BLOCK_Q
    )
    if local_block * BLOCK_Q >= q_len:
        return

    rows = tl.arange(0, BLOCK_M)
    row_token = local_block * BLOCK_Q + rows // BLOCK_H
    head = head_block * BLOCK_H + rows % BLOCK_H
    row_valid = (row_token < q_len) & (head < NUM_HEADS)
    row_pos = prefix_len + row_token  # causal limit: keys 0..row_pos
    token_index = (q_start + row_token).to(tl.int64)
    r = tl.arange(0, RANK_P)
    r_valid = r < RANK
    p = tl.arange(0, ROPE_P)
    p_valid = p < ROPE
    kv_end, tile_lo, tile_hi, active = split_tile_range(
        prefix_len, q_len, local_block, split, num_splits, BLOCK_Q, TILE_N, 1
    )

    # tl.dot wants matching operand types: the cache's, or the query's when the cache is FP8
    if FP8_CACHE:
        tile_dtype = q_lat_ptr.dtype.element_ty
    else:
        tile_dtype = cache_ptr.dtype.element_ty
    q_lat = tl.load(
        q_lat_ptr + token_index[:, None] * stride_lat_token + head[:, None] * stride_lat_head + r[None, :],
        mask=row_valid[:, None] & r_valid[None, :], other=0.0,
    ).to(tile_dtype)
    q_pe = tl.load(
        q_pe_ptr + token_index[:, None] * stride_pe_token + head[:, None] * stride_pe_head + p[None, :],
        mask=row_valid[:, None] & p_valid[None, :], other=0.0,
    ).to(tile_dtype)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, RANK_P], dtype=tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_table_seq
    for tile in range(tile_lo, tile_hi):
        key_pos, key_valid, token_offsets = context_tile(table_row, tile, kv_end, stride_cache_block,
                                                         stride_cache_slot, BLOCK_SIZE, TILE_N)
        latent = tl.load(
            cache_ptr + token_offsets[:, None] + r[None, :],
            mask=key_valid[:, None] & r_valid[None, :], other=0.0,
        )  # [TILE_N, RANK_P]: the key's latent part and the value
        k_pe = tl.load(
            cache_ptr + token_offsets[:, None] + RANK + p[None, :],
            mask=key_valid[:, None] & p_valid[None, :], other=0.0,
        )  # [TILE_N, ROPE_P]
        if FP8_CACHE:
            latent, k_pe = latent.to(tile_dtype), k_pe.to(tile_dtype)
        scores = tl.dot(q_lat, tl.trans(latent), input_precision=DOT_PRECISION)
        scores += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        scores = scores * scale_log2
        visible = (key_pos[None, :] <= row_pos[:, None]) & key_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        prob, alpha, m_i, l_i = online_softmax_step(scores, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(prob.to(latent.dtype), latent, input_precision=DOT_PRECISION)
    if FP8_CACHE:
        acc = acc * k_scale  # every split alike: the merge keeps it

    part_base = (token_index * NUM_HEADS + head) * num_splits
    out_offsets = token_index[:, None] * stride_out_token + head[:, None] * stride_out_head + r[None, :]
    # Partials for the merge kernel (MERGE_IN_KERNEL off: `active` and the counter go unused).
    store_attention(acc, m_i, l_i, row_valid, row_valid[:, None] & r_valid[None, :], part_base, split,
                    active, part_base, r, out_ptr, out_offsets, part_acc_ptr, part_max_ptr,
                    part_sum_ptr, BLOCK_M, RANK_P, RANK, SPLIT, False)


@triton.jit(do_not_specialize=["num_seqs"])
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, rank]
    part_acc_ptr,  # [num_tokens, num_heads, num_splits, rank] fp32
    part_max_ptr,  # [num_tokens, num_heads, num_splits] fp32
    part_sum_ptr,  # [num_tokens, num_heads, num_splits] fp32
    query_start_loc_ptr,
    num_seqs,
    num_splits,
    stride_out_token,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    RANK: tl.constexpr,
    RANK_P: tl.constexpr,
    SPLITS_P: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_seqs):
        return  # padding rows past the last sequence were never attended
    row = token.to(tl.int64) * NUM_HEADS + head
    m, m_max, _, total = split_statistics(part_max_ptr, part_sum_ptr, row, num_splits, SPLITS_P)
    r = tl.arange(0, RANK_P)
    acc = tl.zeros([RANK_P], dtype=tl.float32)
    # Splits are sized from shapes (graphs), so a short context fills only the first few; the
    # filled ones are a prefix (a split that sees no key of this row is followed by later keys
    # only), so the loop stops there. One rank-wide row at a time: all would not fit in registers.
    filled = tl.sum((m > float("-inf")).to(tl.int32), axis=0)
    for i in range(filled):
        weight = tl.exp2(tl.load(part_max_ptr + row * num_splits + i) - m_max)
        part = tl.load(part_acc_ptr + (row * num_splits + i) * RANK + r, mask=r < RANK, other=0.0)
        acc += part * weight
    tl.store(
        out_ptr + token.to(tl.int64) * stride_out_token + head * stride_out_head + r,
        (acc / total).to(out_ptr.dtype.element_ty),
        mask=r < RANK,
    )


def mla_attention_triton(
    q_lat: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank]
    q_pe: torch.Tensor,  # [num_tokens, num_heads, qk_rope_head_dim], rotated
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length after this step's writes
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank], written in place
    num_splits: int | None = None,  # None: chosen from shapes; 1 disables the split
    config: dict | None = None,  # overrides of mla_launch_config (benchmarks sweep these)
    k_scale: float = 1.0,  # FP8 caches: an entry stands for stored * k_scale
) -> torch.Tensor:
    """Causal varlen MQA of [q_lat | q_pe] over the latent cache; returns o_lat (`out`)."""
    num_tokens, num_heads, rank = q_lat.shape
    rope = q_pe.shape[-1]
    check_latent_cache(kv_cache, rank + rope)
    if out.stride(-1) != 1:
        raise ValueError("mla_attention_triton needs `out` with a unit stride on kv_lora_rank")
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    q_lat, q_pe = unit_last_stride(q_lat), unit_last_stride(q_pe)
    check_fp8_query(kv_cache, q_lat.dtype)
    if q_pe.dtype != q_lat.dtype:
        raise ValueError(f"q_lat and q_pe must share a dtype, got {q_lat.dtype} and {q_pe.dtype}")
    fp8 = is_fp8(kv_cache.dtype)
    k_scale = check_scale("k_scale", k_scale) if fp8 else 1.0
    tiles = compute_dtype(kv_cache, q_lat.dtype)
    cfg = {**mla_launch_config(num_heads, max_query_len, tiles), **(config or {})}
    block_m = cfg["BLOCK_M"]
    block_h = min(triton.next_power_of_2(num_heads), block_m)
    block_q = block_m // block_h
    head_blocks = triton.cdiv(num_heads, block_h)
    block_size = kv_cache.shape[1]
    if num_splits is None:
        num_splits = choose_num_splits(
            q_lat.device,
            active_programs=num_seqs * triton.cdiv(max(max_query_len, 1), block_q) * head_blocks,
            max_context=block_table.shape[1] * block_size,
            max_query_len=max_query_len,
            tile_n=cfg["TILE_N"],
        )
    num_q_blocks = num_tokens // block_q + num_seqs
    split = num_splits > 1
    if split:
        f32 = dict(dtype=torch.float32, device=q_lat.device)
        part_acc = torch.empty((num_tokens, num_heads, num_splits, rank), **f32)
        part_max = torch.empty((num_tokens, num_heads, num_splits), **f32)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused by the kernel when not split
    _mla_attention_kernel[(num_q_blocks, head_blocks, num_splits)](
        q_lat, q_pe, kv_cache, out, part_acc, part_max, part_sum,
        block_table, seq_lens, query_start_loc, num_seqs, scale * _LOG2E * k_scale, k_scale,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        out.stride(0), out.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0),
        NUM_HEADS=num_heads, BLOCK_H=block_h, BLOCK_Q=block_q, BLOCK_M=block_m,
        RANK=rank, RANK_P=max(16, triton.next_power_of_2(rank)),  # tl.dot needs K >= 16
        ROPE=rope, ROPE_P=max(16, triton.next_power_of_2(rope)),
        BLOCK_SIZE=block_size, TILE_N=cfg["TILE_N"], SPLIT=split,
        DOT_PRECISION=dot_precision(tiles), FP8_CACHE=fp8,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, query_start_loc, num_seqs, num_splits,
            out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, RANK=rank, RANK_P=triton.next_power_of_2(rank),
            SPLITS_P=triton.next_power_of_2(num_splits),
        )
    return out


def mla_launch_config(num_heads: int, max_query_len: int, cache_dtype: torch.dtype) -> dict:  # the tiles' dtype
    """Tile sizes from shapes only. The accumulator is BLOCK_M x kv_lora_rank in float32 (512
    wide for DeepSeek), so rows stay few: 16 per 4 warps, as the latent tile is what is shared."""
    if cache_dtype.itemsize > 2:  # float32 takes the FMA path and spills when large
        return {"BLOCK_M": 16, "TILE_N": 16, "num_warps": 4, "num_stages": 1}
    rows = max(max_query_len, 1) * triton.next_power_of_2(num_heads)
    block_m = 16 if rows <= 16 else 32
    return {"BLOCK_M": block_m, "TILE_N": 32, "num_warps": block_m // 4, "num_stages": 2}
