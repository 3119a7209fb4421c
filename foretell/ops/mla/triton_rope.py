"""The RoPE pieces of the fused MLA kernels (triton_fused.py, triton_latent_write.py): the rotation
arithmetic as @triton.jit helpers, the rope tile that rides in the per-head matmul launch, the
separate q_pe RoPE kernel for prefill-sized token counts, and the cos/sin tables' checks.

Every helper rounds where the twins' apply_rope_neox / apply_rope_gptj round: cos/sin to the
dtype, then each product and each sum (triton_fused.py says what the CUDA compiler may still
contract).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.common.protocols import RotaryModule
from foretell.ops.pointwise.triton_kernels import _in_dtype

ROPE_STYLES = ("neox", "gptj")


# ---------------------------------------------------------------------- shared pieces


@triton.jit
def _rotate_pairs(x1, x2, cos, sin, dtype: tl.constexpr):
    """apply_rope_*'s arithmetic on float32 pairs (cos/sin already rounded to dtype): each
    product and each sum rounded to dtype. Returns the rotated pair, float32, dtype-exact."""
    o1 = _in_dtype(_in_dtype(x1 * cos, dtype) - _in_dtype(x2 * sin, dtype), dtype)
    o2 = _in_dtype(_in_dtype(x2 * cos, dtype) + _in_dtype(x1 * sin, dtype), dtype)
    return o1, o2


@triton.jit
def _pair_offsets(i, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    # gptj (DeepSeek): pairs (2i, 2i + 1); neox: pairs (i, i + HALF).
    if INTERLEAVED:
        return 2 * i, 2 * i + 1
    else:
        return i, HALF + i


def _rope_tables(rotary_emb: RotaryModule, rope: int, like: torch.Tensor):
    """(cos, sin) [max_positions, rope // 2] float32 with a unit last stride, checked against the
    rope width and the tensors' device."""
    if rotary_emb.style not in ROPE_STYLES:
        raise ValueError(f"rope style {rotary_emb.style!r} is not one of {ROPE_STYLES}")
    if rotary_emb.rotary_dim != rope:
        raise ValueError(
            f"the rotary embedding rotates {rotary_emb.rotary_dim} channels but the rope part is "
            f"{rope} wide (qk_rope_head_dim)"
        )
    cos, sin = rotary_emb.cos_cache, rotary_emb.sin_cache
    if cos.device != like.device:
        raise ValueError(f"the rotary cos/sin tables are on {cos.device}, the inputs on {like.device}")
    return cos.contiguous(), sin.contiguous()


@triton.jit
def _rope_tile(
    x_ptr,  # [num_tokens, num_heads, >= 2 * HALF] rows: the rope part of a head
    out_ptr,  # same layout
    positions_ptr,
    cos_ptr,
    sin_ptr,
    num_tokens,
    head,
    t0,
    stride_x_token,
    stride_x_head,
    stride_out_token,
    stride_out_head,
    stride_cos,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """RoPE of BLOCK_T tokens' rope part of one head, rounded as apply_rope_* rounds."""
    dtype = out_ptr.dtype.element_ty
    t = t0 + tl.arange(0, BLOCK_T)
    i = tl.arange(0, HALF_P)
    mask = (t < num_tokens)[:, None] & (i < HALF)[None, :]
    t = t.to(tl.int64)
    position = tl.load(positions_ptr + t, mask=t < num_tokens, other=0).to(tl.int64)
    table = position[:, None] * stride_cos + i[None, :]
    cos = _in_dtype(tl.load(cos_ptr + table, mask=mask, other=0.0), dtype)  # [BLOCK_T, HALF_P]
    sin = _in_dtype(tl.load(sin_ptr + table, mask=mask, other=0.0), dtype)
    first, second = _pair_offsets(i, HALF, INTERLEAVED)
    src = x_ptr + t[:, None] * stride_x_token + head * stride_x_head
    dst = out_ptr + t[:, None] * stride_out_token + head * stride_out_head
    x1 = tl.load(src + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second[None, :], mask=mask, other=0.0).to(tl.float32)
    o1, o2 = _rotate_pairs(x1, x2, cos, sin, dtype)
    tl.store(dst + first[None, :], o1.to(dtype), mask=mask)
    tl.store(dst + second[None, :], o2.to(dtype), mask=mask)


@triton.jit
def _rope_heads_kernel(
    x_ptr,  # [num_tokens, num_heads, 2 * HALF] rows
    out_ptr,  # same layout
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_x_token,
    stride_x_head,
    stride_out_token,
    stride_out_head,
    stride_cos,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    # Program (token, head block): absorb_query_triton's q_pe RoPE for prefill-sized T. One
    # token per program with heads as rows (as pointwise/triton_kernels.rope_triton does): cos/sin are
    # read once, and per-row position gathers (_rope_tile) ran several times slower here.
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    dtype = out_ptr.dtype.element_ty
    i = tl.arange(0, HALF_P)
    i_ok = i < HALF
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = _in_dtype(tl.load(cos_ptr + position * stride_cos + i, mask=i_ok, other=0.0), dtype)[None, :]
    sin = _in_dtype(tl.load(sin_ptr + position * stride_cos + i, mask=i_ok, other=0.0), dtype)[None, :]
    mask = (heads < NUM_HEADS)[:, None] & i_ok[None, :]
    first, second = _pair_offsets(i, HALF, INTERLEAVED)
    src = x_ptr + token * stride_x_token + heads[:, None] * stride_x_head
    dst = out_ptr + token * stride_out_token + heads[:, None] * stride_out_head
    x1 = tl.load(src + first[None, :], mask=mask, other=0.0).to(tl.float32)  # [BLOCK_HEADS, HALF_P]
    x2 = tl.load(src + second[None, :], mask=mask, other=0.0).to(tl.float32)
    o1, o2 = _rotate_pairs(x1, x2, cos, sin, dtype)
    tl.store(dst + first[None, :], o1.to(dtype), mask=mask)
    tl.store(dst + second[None, :], o2.to(dtype), mask=mask)
