"""RMSNorm (with its residual add) folded into the input loads of the few-row tensor-core linear
(layers/small_m_mma.py), so a decoder layer's norm needs no launch of its own before the qkv or
gate_up projection of a verify step.

A program of the linear first reads its rows' whole hidden states once (x + residual, rounded to
the dtype as RMSNorm's add rounds) to get each row's 1 / rms; the program that owns the first tile
and split also stores that sum, the new residual stream. Each x tile it then feeds the MMA is
normalised as it is loaded, with RMSNorm's roundings: (h * rstd) rounded to the dtype, times the
norm's weight, rounded again. Only the reduction order of the mean of squares differs from the norm
kernel (layers/fused_kernels.py), so a normalised value can differ from it by one rounding.

Measured reason (scripts/ablate_decode.py, H200, Llama-8B): the norms cost 0.121 ms of a 4-token
verify graph (4.377 against 4.257 ms without them), about 1.9 us each, most of it the wait between
two launches. The one-row GEMV does not fold them: its thousands of programs would each read the
hidden states and the norm's weight again.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _hidden_row(x_row, res_row, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """x (+ residual), rounded to x's dtype as torch's `residual + x`; float32 out."""
    h = tl.load(x_row + cols, mask=mask, other=0.0)
    dtype = h.dtype
    h = h.to(tl.float32)
    if HAS_RESIDUAL:
        h = (h + tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    return h


@triton.jit
def rows_rstd(
    x_ptr,  # [M, K] the layer's input before the norm, row stride stride_xm
    res_ptr,  # [M, K] contiguous residual (read with HAS_RESIDUAL)
    res_out_ptr,  # [M, K] contiguous: the new residual, stored where `write`
    stride_xm,
    M,
    K,
    eps,
    write,  # this program stores the new residual
    HAS_RESIDUAL: tl.constexpr,
    NORM_ROWS: tl.constexpr,  # a power of two >= M
    K_P: tl.constexpr,  # a power of two >= K: a row is read in one request
    BLOCK_M: tl.constexpr,
):
    """[BLOCK_M] 1 / sqrt(mean(h^2) + eps) per row of h = x + residual (0 for padding rows)."""
    cols = tl.arange(0, K_P)
    rows = tl.arange(0, BLOCK_M)
    rstd = tl.zeros([BLOCK_M], tl.float32)
    for r in tl.static_range(NORM_ROWS):
        mask = cols < tl.where(r < M, K, 0)  # rows past M read nothing
        h = _hidden_row(x_ptr + r * stride_xm, res_ptr + r * K, cols, mask, HAS_RESIDUAL)  # [K_P]
        if HAS_RESIDUAL:
            if write:
                tl.store(res_out_ptr + r * K + cols, h.to(res_out_ptr.dtype.element_ty), mask=mask)
        row_rstd = tl.rsqrt(tl.sum(h * h, axis=0) / K + eps)
        rstd = tl.where((rows == r) & (r < M), row_rstd, rstd)
    return rstd


@triton.jit
def normed_x_tile(
    x_tile,  # [BLOCK_K, BLOCK_M] pointers into x (x^T's tile)
    res_tile,  # the same tile of the residual (read with HAS_RESIDUAL)
    norm_w_ptr,  # [K] the norm's weight
    lanes,  # [BLOCK_K] the tile's columns of K
    k_ok,  # [BLOCK_K] which columns exist
    row_ok,  # [BLOCK_M] which rows exist
    rstd,  # [BLOCK_M] from rows_rstd
    HAS_RESIDUAL: tl.constexpr,
):
    """The tile of RMSNorm(x, residual) in x's dtype: h * rstd rounded, times the weight, rounded."""
    mask = k_ok[:, None] & row_ok[None, :]
    h = tl.load(x_tile, mask=mask, other=0.0)
    dtype = h.dtype
    h = h.to(tl.float32)
    if HAS_RESIDUAL:
        h = (h + tl.load(res_tile, mask=mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    normed = (h * rstd[None, :]).to(dtype).to(tl.float32)
    weight = tl.load(norm_w_ptr + lanes, mask=k_ok, other=0.0).to(tl.float32)
    return (weight[:, None] * normed).to(dtype)
