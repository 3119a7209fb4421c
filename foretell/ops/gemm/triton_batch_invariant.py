"""The batch-invariant mode's linear on CUDA (issue 23): y = x W^T (+ b) with one kernel for every M
and a reduction order set by K alone.

The default path runs a row through the GEMV at M = 1, the split-K MMA at 2..16 and cuBLAS above,
each summing K in its own order. Here every M runs this one kernel with fixed tiles:
  - program (m, n) owns BLOCK_M rows of x and BLOCK_N rows of W; it walks K in BLOCK_K steps from
    0 upwards, acc[BLOCK_N, BLOCK_M] += dot(W tile, x tile^T) in float32 (the "swapped" MMA of
    triton_mma.py: W is the big operand). Tiles, warps and the MMA shape are constants, never
    chosen by M, N or K, and there is no split-K, so a row's sum has the same terms in the same
    order whether it came alone or among 4096 rows, and whichever tile slot it landed in;
  - the m tiles of one n tile are neighbouring programs (program id 0 runs over m fastest), so
    they read the same W tile out of L2 at large M;
  - `gated` (W = [gate; up], N = 2I): two accumulators over rows j and I + j, silu(gate) * up
    with SiluAndMul's roundings as the epilogue; `float32_out` (the LM head): the float32 sum
    stored as it is, not rounded to x's dtype first;
  - float32 inputs use IEEE products (no TF32: its rounding of inputs is exact-mode-safe but
    would change the model's numbers).

Grids depend only on shapes and nothing syncs with the host: a call can be captured in a graph.
Twin: ops/gemm/batch_invariant.linear_batch_invariant_torch (same contract; another order, so
compared within rounding). tests/ops/test_batch_invariant_gemm.py checks, in Triton's interpreter
(float32 and float16: its bf16 dot is broken), that row r at M = 1 equals row r at M = 2..64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.gemm.triton_gemv import silu_mul_rounded

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_M = 16  # rows of x per program (the MMA's N side)
BLOCK_N = 64  # rows of W per program (a wgmma tile's M)
BLOCK_K = 64  # the K step: every row's sum is over these chunks, in this order
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit
def _batch_invariant_linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N_OUT, K, HALF,  # N_OUT: y's columns (I when gated); HALF: W's row offset of `up` (gated)
    stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, FLOAT32_OUT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows_x = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns
    lanes_k = tl.arange(0, BLOCK_K)
    x_ok = rows_x < M
    col_ok = cols < N_OUT
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + lanes_k
        k_ok = k < K
        xt = tl.load(x_ptr + rows_x[None, :] * stride_xm + k[:, None], mask=x_ok[None, :] & k_ok[:, None], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * K + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(w, xt, input_precision="ieee")
        else:
            acc += tl.dot(w, xt)
        if GATED:
            w_up = tl.load(w_ptr + (cols[:, None] + HALF) * K + k[None, :], mask=col_ok[:, None] & k_ok[None, :],
                           other=0.0)
            if IEEE:
                acc_up += tl.dot(w_up, xt, input_precision="ieee")
            else:
                acc_up += tl.dot(w_up, xt)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        if GATED:
            acc_up += tl.load(b_ptr + HALF + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    dtype = x_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        acc = silu_mul_rounded(gate, up, dtype)
    out_ptrs = y_ptr + rows_x[None, :] * stride_ym + cols[:, None]
    mask = x_ok[None, :] & col_ok[:, None]
    if FLOAT32_OUT:
        tl.store(out_ptrs, acc, mask=mask)
    else:
        tl.store(out_ptrs, acc.to(dtype), mask=mask)


def linear_batch_invariant_triton(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] contiguous
    bias: torch.Tensor | None = None,  # [N]
    gated: bool = False,
    float32_out: bool = False,
) -> torch.Tensor:  # [M, N] (gated: [M, N // 2]); float32 with float32_out, else x's dtype
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K] with the same K, got {list(x.shape)} and "
                         f"{list(weight.shape)}")
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"batch-invariant linear: x and weight must share a dtype of "
                         f"{[str(d) for d in SUPPORTED_DTYPES]}, got {x.dtype} and {weight.dtype}")
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous (row-major [N, K]), got strides {weight.stride()}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated weight is [gate; up] with an even number of rows, got {list(weight.shape)}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{weight.shape[0]}] tensor of {x.dtype}, got "
                         f"{list(bias.shape)} {bias.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    n_out = n // 2 if gated else n
    y = torch.empty(m, n_out, dtype=torch.float32 if float32_out else x.dtype, device=x.device)  # [M, N_OUT]
    if m == 0 or n_out == 0:
        return y
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n_out, BLOCK_N))
    _batch_invariant_linear_kernel[grid](
        x, weight, bias if bias is not None else weight, y,
        m, n_out, k, n_out if gated else 0,
        x.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, GATED=gated, FLOAT32_OUT=float32_out, IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return y
