"""RoPE on q and k and the write of k and v into the paged GQA cache, in one Triton launch.

A decoder layer's attention used to launch the RoPE kernel (rotated q and k into fresh tensors)
and then the KV write kernel (k and v into their cache slots); at batch 1 both are launch-bound
(their H200 times: docs/perf-log.md). Here one program per (token, head block)
does one of three things:
  q blocks   rotate BLOCK_HEADS query heads into q_out [num_tokens, num_heads, head_dim];
  k blocks   rotate key heads straight into the K cache at the token's slot;
  v blocks   copy value heads into the V cache at the token's slot.
A padded row (slot -1) writes nothing to the cache (its q is still rotated: nobody reads it).

With Qwen3's q_norm / k_norm given, each head is RMS-normed first, in the same launch (two
fewer launches a layer). Twin: q_norm / k_norm, RotaryEmbedding.forward, then write_kv_torch
(what Attention.forward_rotary runs without this kernel). The rotation is pointwise/triton_kernels._rope_heads, so q and k are rounded where the twin
rounds them; the cache must have q's dtype (else the twin would round twice). Grids depend only on
shapes and nothing syncs with the host, so a launch can be captured in a CUDA graph.
tests/ops/test_attention_rope_kv.py holds kernel and twin together in Triton's interpreter,
tests/gpu/test_pointwise_kernels_gpu.py on CUDA.

An FP8 cache (fp8_kv.py): the key is normed and rotated with the query's roundings, then stored
as key / k_scale in e4m3 (value / v_scale likewise), as write_kv_torch stores the twin's rotated key;
_rope_heads quantizes by the destination's dtype, so the same call serves both caches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.common.pdl import join_dependent_chain, launch_options, pdl_enabled
from foretell.ops.common.protocols import NormModule
from foretell.ops.attention.fp8_kv import check_scale, is_fp8
from foretell.ops.attention.triton_fp8_kv import to_cache
from foretell.ops.pointwise.triton_kernels import (
    ROPE_STYLES,
    _in_dtype,
    _next_pow2,
    _num_warps,
    _rope_heads,
)


@triton.jit
def _rope_write_kv_kernel(
    positions_ptr,  # [num_tokens] int
    cos_ptr,  # [max_positions, HALF] float32
    sin_ptr,
    q_ptr,  # [num_tokens, NUM_Q_HEADS, HEAD_DIM]
    k_ptr,  # [num_tokens, NUM_K_HEADS, HEAD_DIM]
    v_ptr,  # [num_tokens, NUM_K_HEADS, HEAD_DIM]
    q_out_ptr,  # [num_tokens, NUM_Q_HEADS, HEAD_DIM] contiguous out
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, NUM_K_HEADS, HEAD_DIM]
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64; -1: padding
    q_norm_ptr,  # [HEAD_DIM] q_norm weight (read when HAS_NORM)
    k_norm_ptr,  # [HEAD_DIM] k_norm weight
    q_eps,
    k_eps,
    k_inv_scale,  # 1 / k_scale (FP8 caches: keys and values stored scaled; unused otherwise)
    v_inv_scale,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cos,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2
    HALF_P: tl.constexpr,
    TAIL_P: tl.constexpr,  # power of 2 >= head_dim - rotary_dim
    BLOCK_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size
    INTERLEAVED: tl.constexpr,
    HAS_NORM: tl.constexpr,  # per-head RMSNorm of q and k before the rotation (Qwen3)
    PDL: tl.constexpr,  # launched with programmatic dependent launch (ops/common/pdl.py)
):
    join_dependent_chain(PDL)
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks = (NUM_Q_HEADS + BLOCK_HEADS - 1) // BLOCK_HEADS
    k_blocks = (NUM_K_HEADS + BLOCK_HEADS - 1) // BLOCK_HEADS
    dtype = q_out_ptr.dtype.element_ty
    position = tl.load(positions_ptr + token).to(tl.int64)
    halves = tl.arange(0, HALF_P)
    cos = _in_dtype(tl.load(cos_ptr + position * stride_cos + halves, mask=halves < HALF, other=0.0), dtype)
    sin = _in_dtype(tl.load(sin_ptr + position * stride_cos + halves, mask=halves < HALF, other=0.0), dtype)
    if block < q_blocks:
        _rope_heads(
            q_ptr, q_out_ptr + token * NUM_Q_HEADS * HEAD_DIM, token, block * BLOCK_HEADS, stride_q_token,
            stride_q_head, HEAD_DIM, cos, sin, q_norm_ptr, q_eps, 1.0, NUM_Q_HEADS, HEAD_DIM, HALF, HALF_P, TAIL_P,
            BLOCK_HEADS, INTERLEAVED, HAS_NORM,
        )
    else:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            slot_offset = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot
            kv_block = block - q_blocks
            if kv_block < k_blocks:
                _rope_heads(
                    k_ptr, k_cache_ptr + slot_offset, token, kv_block * BLOCK_HEADS, stride_k_token,
                    stride_k_head, stride_cache_head, cos, sin, k_norm_ptr, k_eps, k_inv_scale, NUM_K_HEADS,
                    HEAD_DIM, HALF, HALF_P, TAIL_P, BLOCK_HEADS, INTERLEAVED, HAS_NORM,
                )
            else:
                heads = (kv_block - k_blocks) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
                dims = tl.arange(0, HEAD_DIM_P)
                mask = (heads[:, None] < NUM_K_HEADS) & (dims[None, :] < HEAD_DIM)
                value = tl.load(v_ptr + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :],
                                mask=mask)
                tl.store(v_cache_ptr + slot_offset + heads[:, None] * stride_cache_head + dims[None, :],
                         to_cache(value, v_inv_scale, v_cache_ptr.dtype.element_ty), mask=mask)


def rope_write_kv_triton(
    positions: torch.Tensor,  # [num_tokens] int
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_cache: torch.Tensor,  # [max_positions, rotary_dim // 2] float32
    sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], query's dtype or e4m3
    slot_mapping: torch.Tensor,  # [num_tokens] int64; slots < 0 are skipped
    style: str = "neox",
    qk_norm: tuple[NormModule, NormModule] | None = None,  # (q_norm, k_norm) over head_dim, applied first
    k_scale: float = 1.0,  # FP8 caches store key / k_scale
    v_scale: float = 1.0,
) -> torch.Tensor:  # rotated query [num_tokens, num_heads, head_dim], contiguous
    """RotaryEmbedding.forward on query and key (after q_norm / k_norm when given), then the KV
    write of the rotated key and value."""
    if style not in ROPE_STYLES:
        raise ValueError(f"rope style {style!r} is not one of {ROPE_STYLES}")
    if query.dim() != 3 or key.dim() != 3 or value.shape != key.shape or query.shape[::2] != key.shape[::2]:
        raise ValueError(f"query/key/value must be [tokens, heads, head_dim] with matching tokens and head_dim, "
                         f"got {list(query.shape)}, {list(key.shape)}, {list(value.shape)}")
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (num_k_heads, head_dim):
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, {num_k_heads}, {head_dim}], "
                         f"got {list(kv_cache.shape)}")
    cache_ok = is_fp8(kv_cache.dtype) or kv_cache.dtype == query.dtype
    if not (query.dtype == key.dtype == value.dtype and cache_ok) or kv_cache.stride(-1) != 1:
        raise ValueError(f"query, key, value and the cache must share a dtype, or the cache be FP8 (got "
                         f"{query.dtype}, {key.dtype}, {value.dtype}, {kv_cache.dtype}) and the cache a unit "
                         f"last stride")
    if qk_norm is not None and any(
        n.weight.shape != (head_dim,) or n.weight.dtype != query.dtype or n.weight.device != query.device
        for n in qk_norm
    ):
        raise ValueError(f"q_norm / k_norm must have a [{head_dim}] {query.dtype} weight on {query.device}")
    half = cos_cache.shape[1]
    if 2 * half > head_dim or sin_cache.shape != cos_cache.shape:
        raise ValueError(f"cos/sin caches [{list(cos_cache.shape)}] do not fit head_dim {head_dim}")
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return q_out
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    cos_cache, sin_cache = cos_cache.contiguous(), sin_cache.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    half_p = _next_pow2(half)
    block_heads = min(max(1, 1024 // max(half_p, _next_pow2(head_dim) // 2)), _next_pow2(max(num_q_heads, num_k_heads)))
    q_blocks, k_blocks = triton.cdiv(num_q_heads, block_heads), triton.cdiv(num_k_heads, block_heads)
    q_norm, k_norm = qk_norm if qk_norm is not None else (None, None)
    pdl = pdl_enabled(query)
    _rope_write_kv_kernel[(num_tokens, q_blocks + 2 * k_blocks)](
        positions.contiguous(), cos_cache, sin_cache, query, key, value, q_out, k_cache, v_cache, slot_mapping,
        q_norm.weight if q_norm is not None else query, k_norm.weight if k_norm is not None else key,
        q_norm.eps if q_norm is not None else 0.0, k_norm.eps if k_norm is not None else 0.0,
        1.0 / check_scale("k_scale", k_scale), 1.0 / check_scale("v_scale", v_scale),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cos_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=_next_pow2(head_dim),
        HALF=half,
        HALF_P=half_p,
        TAIL_P=_next_pow2(max(head_dim - 2 * half, 1)),
        BLOCK_HEADS=block_heads,
        BLOCK_SIZE=kv_cache.shape[2],
        INTERLEAVED=style == "gptj",
        HAS_NORM=qk_norm is not None,
        PDL=pdl,
        num_warps=_num_warps(2 * block_heads * half_p),
        **launch_options(pdl),
    )
    return q_out
