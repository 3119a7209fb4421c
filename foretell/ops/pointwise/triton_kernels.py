"""Fused Triton kernels for a decoder layer's small ops: residual add + RMSNorm, RoPE on q and k
(neox and gptj pairings), and SiLU-and-mul. Each replaces a chain of 3-18 small torch kernels
with one launch.

Twins: RMSNorm.forward (norm.py), RotaryEmbedding.forward (rotary.py, either style) and
SiluAndMul.forward (activation.py) hold the reference semantics and are what CPUs run;
tests/ops/test_pointwise_kernels.py holds kernels and twins together on random inputs (in Triton's
interpreter on the CPU), tests/gpu/test_pointwise_kernels_gpu.py does the same on CUDA in bf16.

Every kernel rounds where its twin rounds: arithmetic runs in float32 and is cast to the input
dtype at each point where the torch path makes a tensor of that dtype (`residual + x`, the
normalised row before the weight multiply, each RoPE product, silu(gate) before `* up`). So on
CUDA the outputs match the twins bit for bit except where a reduction order or an approximate
exp/rsqrt differ (the norm's mean of squares, silu's exp), and there within one rounding of the
dtype.

The layers call these only when ops/common/kernel_choice.use_triton says so (CUDA tensors, triton
importable, no autograd: the kernels have no backward, so training runs the twins), and import
this module only then, so a CPU process never imports triton. Grids depend only on shapes, nothing
syncs with the host, and every output is a fresh contiguous tensor (or the `out` given), so a
launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.attention.triton_fp8_kv import to_cache
from foretell.ops.common.pdl import join_dependent_chain, launch_options, pdl_enabled


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _num_warps(tile_elements: int) -> int:
    # About 8 elements of the tile per thread, 1 to 16 warps.
    return max(1, min(16, tile_elements // 256))


def _output(out: torch.Tensor | None, shape, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if out.shape != tuple(shape) or out.dtype != like.dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {list(shape)} {like.dtype} tensor, got "
            f"{list(out.shape)} {out.dtype} (contiguous: {out.is_contiguous()})"
        )
    return out


# ---------------------------------------------------------------------- residual add + RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    num_rows,
    hidden,
    eps,
    stride_x_token,
    stride_x_head,
    stride_r_token,
    stride_r_head,
    stride_ro_row,  # residual_out's row stride (hidden when contiguous)
    NUM_HEADS: tl.constexpr,  # rows per token: heads of a per-head norm, else 1
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (ops/common/pdl.py)
):
    join_dependent_chain(PDL)  # the next kernel (a projection's GEMV) streams weights meanwhile
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    token = rows // NUM_HEADS
    head = rows % NUM_HEADS
    dtype = out_ptr.dtype.element_ty
    x_offsets = (token * stride_x_token + head * stride_x_head)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_offsets, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_ROWS, BLOCK_H]
    out_offsets = rows[:, None] * hidden + cols[None, :]
    if HAS_RESIDUAL:
        r_offsets = (token * stride_r_token + head * stride_r_head)[:, None] + cols[None, :]
        residual = tl.load(residual_ptr + r_offsets, mask=mask, other=0.0).to(tl.float32)
        summed = (residual + x).to(dtype)  # torch's `residual + x`, rounded to the dtype
        tl.store(residual_out_ptr + rows[:, None] * stride_ro_row + cols[None, :], summed, mask=mask)
        x = summed.to(tl.float32)
    variance = tl.sum(x * x, axis=1) / hidden  # [BLOCK_ROWS]; padding columns hold 0
    normed = (x * tl.rsqrt(variance + eps)[:, None]).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offsets, (weight[None, :] * normed).to(dtype), mask=mask)


def norm_rows_per_program(block_h: int) -> int:
    """Rows of width block_h (a power of two) per RMSNorm program: about 4096 elements a tile."""
    return max(1, 4096 // block_h)


def _as_token_head_rows(t: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [tokens, heads, hidden]
    if t.dim() != 3:
        t = t.reshape(-1, 1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm_triton(
    x: torch.Tensor,  # [..., hidden]; 3-D [tokens, heads, head_dim] for a per-head norm
    weight: torch.Tensor,  # [hidden], x's dtype
    eps: float,
    residual: torch.Tensor | None = None,  # x's shape and dtype
    out: torch.Tensor | None = None,  # contiguous, x's shape: where to write normed
    residual_out: torch.Tensor | None = None,  # the same for new_residual; a 2-D one may have any row stride
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual) as RMSNorm.forward returns them, x's shape: normed contiguous,
    new_residual contiguous (or residual_out), or x itself when there is no residual (as in the
    torch path)."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{hidden}] {x.dtype}, got {list(weight.shape)} {weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x ({list(x.shape)} {x.dtype}), got "
            f"{list(residual.shape)} {residual.dtype}"
        )
    out = _output(out, x.shape, x)
    if residual is None:
        residual_out = x
    elif residual_out is None or residual_out.dim() != 2 or residual_out.stride(-1) != 1:
        residual_out = _output(residual_out, x.shape, x)
    elif residual_out.shape != x.shape or residual_out.dtype != x.dtype:
        raise ValueError(f"residual_out must be a {list(x.shape)} {x.dtype} tensor, got "
                         f"{list(residual_out.shape)} {residual_out.dtype}")
    if x.numel() == 0:
        return out, residual_out
    rows = _as_token_head_rows(x)  # [tokens, heads, hidden]
    res_rows = _as_token_head_rows(residual) if residual is not None else rows
    num_rows = rows.shape[0] * rows.shape[1]
    block_h = _next_pow2(hidden)
    # Short rows (per-head norms) share a program so each program still moves a few KiB. The tile
    # (and its warps) is set by the row width alone, never by num_rows: Triton lays a smaller tile
    # out with fewer elements per thread, which changes a row's sum-of-squares order (a 2-row
    # k_norm at batch 1 against 4+ rows, issue 23's batch-invariant mode).
    block_rows = norm_rows_per_program(block_h)
    pdl = pdl_enabled(x)
    _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
        rows, res_rows, weight, out, residual_out,
        num_rows, hidden, eps,
        rows.stride(0), rows.stride(1), res_rows.stride(0), res_rows.stride(1),
        residual_out.stride(0) if residual is not None and residual_out.dim() == 2 else hidden,
        NUM_HEADS=rows.shape[1],
        HAS_RESIDUAL=residual is not None,
        BLOCK_ROWS=block_rows,
        BLOCK_H=block_h,
        PDL=pdl,
        num_warps=_num_warps(block_rows * block_h),
        **launch_options(pdl),
    )
    return out, residual_out


# ---------------------------------------------------------------------- RoPE (neox and gptj)


@triton.jit
def _in_dtype(v, dtype: tl.constexpr):
    # A float32 value rounded as a tensor of `dtype` would hold it.
    return v.to(dtype).to(tl.float32)


@triton.jit
def rms_norm_heads(x1, x2, rest, w1, w2, w_rest, eps, HEAD_DIM: tl.constexpr, dtype: tl.constexpr):
    """RMSNorm.forward of heads held as their rotary pairs' halves x1, x2 [R, HALF_P] and the
    channels past rotary_dim, rest [R, TAIL_P] (padding lanes 0), weights split alike: normalise
    in float32, round, times the weight, round (float32 out, rounded to dtype)."""
    squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(rest * rest, axis=1)
    rstd = tl.rsqrt(squares / HEAD_DIM + eps)[:, None]  # [R, 1]
    x1 = _in_dtype(_in_dtype(x1 * rstd, dtype) * w1, dtype)
    x2 = _in_dtype(_in_dtype(x2 * rstd, dtype) * w2, dtype)
    rest = _in_dtype(_in_dtype(rest * rstd, dtype) * w_rest, dtype)
    return x1, x2, rest


@triton.jit
def rotate_pairs(x1, x2, cos, sin, dtype: tl.constexpr):
    """The rotation of each pair (x1, x2) by the angle of (cos, sin), already rounded to dtype:
    apply_rope_neox's / apply_rope_gptj's arithmetic, each product rounded to the dtype as torch
    does; the sums are rounded by the caller's store (or cast)."""
    o1 = _in_dtype(x1 * cos, dtype) - _in_dtype(x2 * sin, dtype)
    o2 = _in_dtype(x2 * cos, dtype) + _in_dtype(x1 * sin, dtype)
    return o1, o2


@triton.jit
def _rope_heads(
    x_ptr,
    dst_ptr,  # this token's first destination head (out rows, or a KV cache slot)
    token,
    first_head,
    stride_token,
    stride_head,
    dst_stride_head,
    cos,  # [HALF_P] float32, already rounded to the dtype
    sin,
    norm_w_ptr,  # [HEAD_DIM] per-head RMSNorm weight (read when HAS_NORM)
    eps,
    inv_scale,  # 1 / scale of an e4m3 destination (an FP8 KV cache); not read for others
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2
    HALF_P: tl.constexpr,
    TAIL_P: tl.constexpr,  # power of 2 >= head_dim - rotary_dim
    BLOCK_HEADS: tl.constexpr,
    INTERLEAVED: tl.constexpr,  # gptj: pairs (2i, 2i + 1); neox: pairs (i, i + HALF)
    HAS_NORM: tl.constexpr,  # RMSNorm each head first (Qwen3's q_norm / k_norm), with its roundings
):
    """RoPE (after the per-head RMSNorm when HAS_NORM) of BLOCK_HEADS heads from first_head of
    x's token into dst, rounded to x's dtype where the twin rounds; a destination of x's dtype
    stores that, an e4m3 one (an FP8 KV cache) that quantized with inv_scale (to_cache), as the
    twin quantizes its rotated key."""
    dtype = x_ptr.dtype.element_ty
    dst_dtype = dst_ptr.dtype.element_ty
    heads = first_head + tl.arange(0, BLOCK_HEADS)
    head_ok = (heads < NUM_HEADS)[:, None]
    dims = tl.arange(0, HALF_P)[None, :]
    mask = head_ok & (dims < HALF)
    src = x_ptr + token * stride_token + heads[:, None] * stride_head
    dst = dst_ptr + heads[:, None] * dst_stride_head
    if INTERLEAVED:
        first, second = 2 * dims, 2 * dims + 1
    else:
        first, second = dims, HALF + dims
    x1 = tl.load(src + first, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_HEADS, HALF_P]
    x2 = tl.load(src + second, mask=mask, other=0.0).to(tl.float32)
    tail = 2 * HALF + tl.arange(0, TAIL_P)[None, :]  # partial rotary: channels past rotary_dim
    tail_mask = head_ok & (tail < HEAD_DIM)
    if HEAD_DIM > 2 * HALF:
        rest = tl.load(src + tail, mask=tail_mask, other=0.0).to(tl.float32)  # [BLOCK_HEADS, TAIL_P]
    else:
        rest = tl.zeros([BLOCK_HEADS, TAIL_P], dtype=tl.float32)
    if HAS_NORM:
        w1 = tl.load(norm_w_ptr + first, mask=dims < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(norm_w_ptr + second, mask=dims < HALF, other=0.0).to(tl.float32)
        w_rest = tl.load(norm_w_ptr + tail, mask=tail < HEAD_DIM, other=0.0).to(tl.float32)
        x1, x2, rest = rms_norm_heads(x1, x2, rest, w1, w2, w_rest, eps, HEAD_DIM, dtype)
    o1, o2 = rotate_pairs(x1, x2, cos[None, :], sin[None, :], dtype)
    tl.store(dst + first, to_cache(o1.to(dtype), inv_scale, dst_dtype), mask=mask)
    tl.store(dst + second, to_cache(o2.to(dtype), inv_scale, dst_dtype), mask=mask)
    if HEAD_DIM > 2 * HALF:  # the channels past rotary_dim pass through (normed when HAS_NORM)
        tl.store(dst + tail, to_cache(rest.to(dtype), inv_scale, dst_dtype), mask=tail_mask)


@triton.jit
def _rope_kernel(
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cache,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    TAIL_P: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    # Program (token, head block); head blocks run over q's heads, then k's.
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    dtype = q_out_ptr.dtype.element_ty
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_P)
    cos = _in_dtype(tl.load(cos_ptr + position * stride_cache + dims, mask=dims < HALF, other=0.0), dtype)
    sin = _in_dtype(tl.load(sin_ptr + position * stride_cache + dims, mask=dims < HALF, other=0.0), dtype)
    q_blocks = (NUM_Q_HEADS + BLOCK_HEADS - 1) // BLOCK_HEADS
    if block < q_blocks:
        _rope_heads(
            q_ptr, q_out_ptr + token * NUM_Q_HEADS * HEAD_DIM, token, block * BLOCK_HEADS, stride_q_token,
            stride_q_head, HEAD_DIM, cos, sin, q_ptr, 0.0, 1.0, NUM_Q_HEADS, HEAD_DIM, HALF, HALF_P, TAIL_P,
            BLOCK_HEADS, INTERLEAVED, False,
        )
    else:
        _rope_heads(
            k_ptr, k_out_ptr + token * NUM_K_HEADS * HEAD_DIM, token, (block - q_blocks) * BLOCK_HEADS,
            stride_k_token, stride_k_head, HEAD_DIM, cos, sin, k_ptr, 0.0, 1.0, NUM_K_HEADS, HEAD_DIM, HALF,
            HALF_P, TAIL_P, BLOCK_HEADS, INTERLEAVED, False,
        )


ROPE_STYLES = ("neox", "gptj")


def rope_triton(
    positions: torch.Tensor,  # [num_tokens] int
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_cache: torch.Tensor,  # [max_positions, rotary_dim // 2] float32
    sin_cache: torch.Tensor,  # [max_positions, rotary_dim // 2] float32
    q_out: torch.Tensor | None = None,  # contiguous, query's shape: where to write
    k_out: torch.Tensor | None = None,
    style: str = "neox",  # "neox": rotate halves (Llama, Qwen); "gptj": interleaved pairs (DeepSeek)
) -> tuple[torch.Tensor, torch.Tensor]:  # rotated query, key: contiguous, same shapes
    """RotaryEmbedding.forward: the first rotary_dim channels of every head rotated by its
    token's position, the rest copied."""
    if style not in ROPE_STYLES:
        raise ValueError(f"rope style {style!r} is not one of {ROPE_STYLES}")
    if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
        raise ValueError(f"query/key must be [tokens, heads, head_dim], got {list(query.shape)}, {list(key.shape)}")
    if query.dtype != key.dtype:
        raise ValueError(f"query and key dtypes differ: {query.dtype} vs {key.dtype}")
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    half = cos_cache.shape[1]
    if 2 * half > head_dim or sin_cache.shape != cos_cache.shape:
        raise ValueError(f"cos/sin caches [{list(cos_cache.shape)}] do not fit head_dim {head_dim}")
    query = query if query.stride(-1) == 1 else query.contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    cos_cache, sin_cache = cos_cache.contiguous(), sin_cache.contiguous()
    q_out = _output(q_out, query.shape, query)
    k_out = _output(k_out, key.shape, key)
    if num_tokens == 0:
        return q_out, k_out
    half_p = _next_pow2(half)
    block_heads = min(max(1, 1024 // half_p), _next_pow2(max(num_q_heads, num_k_heads)))
    grid = (num_tokens, triton.cdiv(num_q_heads, block_heads) + triton.cdiv(num_k_heads, block_heads))
    _rope_kernel[grid](
        positions.contiguous(), cos_cache, sin_cache, query, key, q_out, k_out,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_P=half_p,
        TAIL_P=_next_pow2(max(head_dim - 2 * half, 1)),
        BLOCK_HEADS=block_heads,
        INTERLEAVED=style == "gptj",
        num_warps=_num_warps(2 * block_heads * half_p),
    )
    return q_out, k_out


# ---------------------------------------------------------------------- SiLU-and-mul


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    intermediate,
    stride_token,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    dtype = out_ptr.dtype.element_ty
    row = gate_up_ptr + token * stride_token
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    # F.silu computes x / (1 + exp(-x)) in float32 and rounds; `* up` rounds again.
    silu = _in_dtype(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + token * intermediate + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul_triton(
    gate_up: torch.Tensor,  # [..., 2 * intermediate]
    out: torch.Tensor | None = None,  # contiguous [..., intermediate]: where to write
) -> torch.Tensor:  # [..., intermediate], contiguous
    """silu(gate) * up on a fused gate_up projection, as SiluAndMul.forward."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate then up), got {gate_up.shape[-1]}")
    intermediate = gate_up.shape[-1] // 2
    out = _output(out, (*gate_up.shape[:-1], intermediate), gate_up)
    if out.numel() == 0:
        return out
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    block = min(1024, _next_pow2(intermediate))
    grid = (rows.shape[0], triton.cdiv(intermediate, block))
    _silu_and_mul_kernel[grid](
        rows, out, intermediate, rows.stride(0), BLOCK=block, num_warps=_num_warps(block)
    )
    return out
