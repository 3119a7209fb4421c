"""FP8-weight linears for a few rows: y = x (q * s)^T (+ b) for x [M, K] (1 <= M <= 16) and an FP8
weight q [N, K] with its float32 scales s, per 128x128 block (DeepSeek-V3 / Kimi-K2 checkpoints) or
per output channel (`quantization="fp8"`); layouts in fp8_reference.py, which holds the twin
(fp8_linear_torch).

Decode, verify and draft steps read every weight once for a handful of rows, so they are bound by
the weight bytes: these kernels read the weight in its 8 bits and scale it in-kernel, summing in
float32. x stays in its dtype (no activation quantization: the result is the dequantized weight's
product, as the CPU path computes it).

  GEMV (up to 4 rows, Fp8GemvConfig; M = 1 is decode at batch 1): program p owns BLOCK_N rows of W
    over all of K in [BLOCK_N, BLOCK_K] tiles, as ops/gemm/triton_gemv.py. Per tile, the products
    are summed per group of SUB columns (SUB = the quant block's width, 128, or the tile when
    smaller), each group's sum times its block's scale, then summed: one scale multiply per
    128 products. Per-channel scales multiply the row's sum once, in the epilogue.
  MMA (up to 16 rows, fp16 / bf16 x, Fp8MmaConfig): program p owns 64 rows of W (one wgmma tile)
    and multiplies [64, BLOCK_K] weight tiles, converted to x's dtype in registers (exact: every
    e4m3 value is a bf16 and an fp16 value), by x^T tiles [BLOCK_K, 16] on tensor cores; with
    BLOCK_K dividing the quant block's width, each tile's float32 product is scaled by one scale
    per row of W before it is added.

Both request their first weight tile before waiting for the kernel before them and let the next
kernel launch once their reads are done (programmatic dependent launch, ops/common/pdl.py). Grids
depend only on shapes and the output is one torch.empty, so calls can be captured in CUDA graphs.
Tiles are first guesses to be tuned on the H200 (no split-K yet: layers with fewer 64-row tiles
than multiprocessors would gain from one, as triton_mma.py's do).

This module imports triton: only ops/gemm/fp8_dispatch.py imports it, on CUDA (and the
interpreter tests, tests/ops/test_gemm_fp8.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from foretell.ops.common.pdl import launch_options, let_next_kernel_launch, pdl_enabled, wait_for_previous_kernel
from foretell.ops.gemm.fp8_reference import check_fp8_weight

GEMV_MAX_M = 4
MAX_M = 16
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MMA_X_DTYPES = (torch.bfloat16, torch.float16)
MMA_BLOCK_N = 64


@dataclass(frozen=True)
class Fp8GemvConfig:
    block_m: int  # power of two >= M
    block_n: int  # rows of W per program
    block_k: int  # columns of W per tile (power of two)
    num_warps: int

    def __str__(self) -> str:
        return f"fp8 gemv BM{self.block_m} BN{self.block_n} BK{self.block_k} w{self.num_warps}"


@dataclass(frozen=True)
class Fp8MmaConfig:
    block_k: int  # columns of W per tile (power of two >= 16; divides the quant block's width)
    num_stages: int = 4
    num_warps: int = 4
    block_n: int = MMA_BLOCK_N

    def __str__(self) -> str:
        return f"fp8 mma BN{self.block_n} BK{self.block_k} s{self.num_stages} w{self.num_warps}"


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def kernel_block_ok(block_size: tuple[int, int] | None) -> bool:
    """The kernels take per-channel scales, or blocks whose width is a power of two (every
    published checkpoint: 128 x 128); other widths go to the torch twin."""
    return block_size is None or (block_size[1] & (block_size[1] - 1)) == 0


def gemv_config(m: int, n: int, k: int, block_k: int | None = None, block_n: int | None = None) -> Fp8GemvConfig:
    """1024-column tiles (1 KiB of FP8 per row of W), 4 rows per program at one row of x; fewer
    columns with more rows of x, whose products all sit in registers at once."""
    if not 1 <= m <= GEMV_MAX_M or n < 1 or k < 1:
        raise ValueError(f"FP8 GEMV needs 1 <= M <= {GEMV_MAX_M}, N >= 1, K >= 1; got M={m}, N={n}, K={k}")
    block_m = _next_pow2(m)
    if block_k is None:
        block_k = min(_next_pow2(k), 1024 // block_m)
    block_n = block_n or 4
    num_warps = max(1, min(8, block_m * block_n * block_k // (32 * 32)))
    return Fp8GemvConfig(block_m, block_n, max(16, block_k), num_warps)


def mma_config(k: int, block_size: tuple[int, int] | None) -> Fp8MmaConfig:
    """128-column tiles (one scale per row of W per tile for 128-wide blocks), 4 in flight."""
    block_k = min(128, max(16, _next_pow2(k)))
    if block_size is not None:
        block_k = max(16, min(block_k, block_size[1]))
    return Fp8MmaConfig(block_k)


def default_config(m: int, n: int, k: int, dtype: torch.dtype, block_size: tuple[int, int] | None):
    """The GEMV for one row (or a float32 x), the MMA for more rows of fp16 / bf16."""
    if m == 1 or dtype not in MMA_X_DTYPES:
        return gemv_config(m, n, k)
    return mma_config(k, block_size)


@triton.jit
def _gemv_accumulate(acc, w, x_ptr, stride_xm, M, k0, K, scale_ptr, stride_scale, rows, row_ok,
                     QBLOCK_N: tl.constexpr, QBLOCK_K: tl.constexpr, PER_CHANNEL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] + the tile's products: w [BLOCK_N, BLOCK_K] (FP8 at columns k0..) with
    x[:, k0..], summed per SUB columns and scaled per block (PER_CHANNEL: summed, scaled later)."""
    NSUB: tl.constexpr = BLOCK_K // SUB
    w = w.to(tl.float32)
    cols = k0 + tl.arange(0, BLOCK_K)
    if BLOCK_M == 1:
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)  # [BLOCK_K]
        products = (w * x[None, :])[None, :, :]  # [1, BLOCK_N, BLOCK_K]
    else:
        m = tl.arange(0, BLOCK_M)
        x = tl.load(x_ptr + m[:, None] * stride_xm + cols[None, :], mask=(m < M)[:, None] & (cols < K)[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        products = w[None, :, :] * x[:, None, :]  # [BLOCK_M, BLOCK_N, BLOCK_K]
    if PER_CHANNEL:
        acc += tl.sum(products, axis=2)
    else:
        sub_cols = k0 + tl.arange(0, NSUB) * SUB
        scales = tl.load(scale_ptr + (rows // QBLOCK_N)[:, None] * stride_scale + (sub_cols // QBLOCK_K)[None, :],
                         mask=row_ok[:, None] & (sub_cols < K)[None, :], other=0.0)  # [BLOCK_N, NSUB]
        sums = tl.sum(tl.reshape(products, [BLOCK_M, BLOCK_N, NSUB, SUB]), axis=3)  # [BLOCK_M, BLOCK_N, NSUB]
        acc += tl.sum(sums * scales[None, :, :], axis=2)
    return acc


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [M, K], unit column stride
    w_ptr,  # [N, K] float8e4nv, contiguous
    scale_ptr,  # [ceil(N / QBLOCK_N), ceil(K / QBLOCK_K)] float32 (PER_CHANNEL: [N, 1])
    bias_ptr,  # [N] (unread without HAS_BIAS)
    out_ptr,  # [M, N] contiguous, x's dtype or float32
    M,
    N,
    K,
    stride_xm,
    stride_scale,
    QBLOCK_N: tl.constexpr,
    QBLOCK_K: tl.constexpr,  # a power of two (unused with PER_CHANNEL)
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB: tl.constexpr,  # columns per scale: min(BLOCK_K, QBLOCK_K), BLOCK_K with PER_CHANNEL
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of W = output columns
    row_ok = rows < N
    lanes = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + rows[:, None].to(tl.int64) * K + lanes[None, :]  # [BLOCK_N, BLOCK_K] at k = 0
    # W is streamed once and no kernel of a step writes it: requested before the wait (pdl.py).
    w = tl.load(w_tile, mask=row_ok[:, None] & (lanes < K)[None, :], other=0.0, eviction_policy="evict_first")
    wait_for_previous_kernel(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc = _gemv_accumulate(acc, w, x_ptr, stride_xm, M, 0, K, scale_ptr, stride_scale, rows, row_ok,
                           QBLOCK_N, QBLOCK_K, PER_CHANNEL, BLOCK_M, BLOCK_N, BLOCK_K, SUB)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = tl.load(w_tile + k0, mask=row_ok[:, None] & ((k0 + lanes) < K)[None, :], other=0.0,
                    eviction_policy="evict_first")
        acc = _gemv_accumulate(acc, w, x_ptr, stride_xm, M, k0, K, scale_ptr, stride_scale, rows, row_ok,
                               QBLOCK_N, QBLOCK_K, PER_CHANNEL, BLOCK_M, BLOCK_N, BLOCK_K, SUB)
    let_next_kernel_launch(PDL)
    if PER_CHANNEL:
        acc *= tl.load(scale_ptr + rows * stride_scale, mask=row_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    m = tl.arange(0, BLOCK_M)
    dtype = x_ptr.dtype.element_ty  # results round to x's dtype (a float32 out holds them as they are)
    tl.store(out_ptr + m[:, None] * N + rows[None, :], acc.to(dtype).to(out_ptr.dtype.element_ty),
             mask=(m < M)[:, None] & row_ok[None, :])


@triton.jit
def _fp8_mma_kernel(
    x_ptr,  # [M, K] fp16 / bf16, unit column stride
    w_ptr,  # [N, K] float8e4nv, contiguous
    scale_ptr,  # [ceil(N / QBLOCK_N), ceil(K / QBLOCK_K)] float32 (PER_CHANNEL: [N, 1])
    bias_ptr,  # [N] (unread without HAS_BIAS)
    out_ptr,  # [M, N] contiguous, x's dtype or float32
    M,
    N,
    K,
    stride_xm,
    stride_scale,
    QBLOCK_N: tl.constexpr,
    QBLOCK_K: tl.constexpr,  # a multiple of BLOCK_K (unused with PER_CHANNEL)
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows_w = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns
    w_ok = rows_w < N
    rows_x = tl.arange(0, BLOCK_M)
    x_ok = rows_x < M
    lanes = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + rows_w[:, None].to(tl.int64) * K + lanes[None, :]  # [BLOCK_N, BLOCK_K]
    x_tile = x_ptr + rows_x[None, :] * stride_xm + lanes[:, None]  # [BLOCK_K, BLOCK_M]
    scale_rows = scale_ptr + (rows_w // QBLOCK_N) * stride_scale  # [BLOCK_N]
    dtype = x_ptr.dtype.element_ty
    w = tl.load(w_tile, mask=w_ok[:, None] & (lanes < K)[None, :], other=0.0, eviction_policy="evict_first")
    wait_for_previous_kernel(PDL)
    x = tl.load(x_tile, mask=(lanes < K)[:, None] & x_ok[None, :], other=0.0)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if PER_CHANNEL:
        acc = tl.dot(w.to(dtype), x, acc)
    else:
        acc += tl.dot(w.to(dtype), x) * tl.load(scale_rows, mask=w_ok, other=0.0)[:, None]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k_ok = (lanes + k0) < K
        w = tl.load(w_tile + k0, mask=w_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_tile + k0, mask=k_ok[:, None] & x_ok[None, :], other=0.0)
        if PER_CHANNEL:
            acc = tl.dot(w.to(dtype), x, acc)
        else:
            scales = tl.load(scale_rows + k0 // QBLOCK_K, mask=w_ok, other=0.0)  # [BLOCK_N]
            acc += tl.dot(w.to(dtype), x) * scales[:, None]
    let_next_kernel_launch(PDL)
    if PER_CHANNEL:
        acc *= tl.load(scale_rows, mask=w_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_w, mask=w_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows_x[None, :] * N + rows_w[:, None], acc.to(dtype).to(out_ptr.dtype.element_ty),
             mask=w_ok[:, None] & x_ok[None, :])


def check_few_rows_inputs(x, weight, weight_scale, block_size, bias, max_m: int, dtypes) -> None:
    """Raise a ValueError naming what is wrong unless the few-row kernels can take these."""
    check_fp8_weight(weight, weight_scale, block_size)
    if not kernel_block_ok(block_size):
        raise ValueError(f"the FP8 kernels take blocks of a power-of-two width, got block_size {block_size}")
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, K={k}] for an FP8 weight {list(weight.shape)}, got {list(x.shape)}")
    if not 1 <= x.shape[0] <= max_m:
        raise ValueError(f"this FP8 kernel takes 1 to {max_m} rows, got x {list(x.shape)}")
    if x.dtype not in dtypes:
        raise ValueError(f"this FP8 kernel takes x in {[str(d) for d in dtypes]}, got {x.dtype}")
    if not weight.is_contiguous() or not weight_scale.is_contiguous():
        raise ValueError("an FP8 weight and its scale must be contiguous")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}] {x.dtype} tensor, got {list(bias.shape)} {bias.dtype}")
    devices = {t.device for t in (x, weight, weight_scale) + (() if bias is None else (bias,))}
    if len(devices) != 1:
        raise ValueError(f"x, weight, weight_scale and bias must be on one device, got {sorted(map(str, devices))}")


def fp8_few_rows_linear(
    x: torch.Tensor,  # [M, K], 1 <= M <= 16; any row stride
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, contiguous
    weight_scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] or [N, 1] float32, contiguous
    block_size: tuple[int, int] | None,  # None: per-channel scales
    bias: torch.Tensor | None = None,  # [N], x's dtype
    config: Fp8GemvConfig | Fp8MmaConfig | None = None,  # None: default_config's choice
    float32_out: bool = False,  # the values rounded to x's dtype, stored as float32
) -> torch.Tensor:  # [M, N] contiguous, x's dtype (or float32)
    """fp8_linear_torch(x, weight, weight_scale, block_size, bias) reading the FP8 weight once."""
    m = x.shape[0] if x.dim() == 2 else 0
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    if config is None and 1 <= m <= MAX_M:
        config = default_config(m, n, k, x.dtype, block_size)
    mma = isinstance(config, Fp8MmaConfig)
    check_few_rows_inputs(x, weight, weight_scale, block_size, bias, MAX_M if mma else GEMV_MAX_M,
                          MMA_X_DTYPES if mma else X_DTYPES)
    qblock_n, qblock_k = block_size if block_size is not None else (1, 1)
    if mma and block_size is not None and qblock_k % config.block_k:
        raise ValueError(f"config {config}: block_k must divide the quant block's width {qblock_k}")
    if not mma and config.block_m < m:
        raise ValueError(f"config {config} has block_m {config.block_m} < M={m}")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((m, n), dtype=torch.float32 if float32_out else x.dtype, device=x.device)
    pdl = pdl_enabled(x)
    common = dict(QBLOCK_N=qblock_n, QBLOCK_K=qblock_k, PER_CHANNEL=block_size is None, HAS_BIAS=bias is not None,
                  PDL=pdl, BLOCK_K=config.block_k, num_warps=config.num_warps, **launch_options(pdl))
    args = (x, weight, weight_scale, bias if bias is not None else out, out, m, n, k, x.stride(0),
            weight_scale.stride(0))
    if mma:
        _fp8_mma_kernel[(triton.cdiv(n, config.block_n),)](
            *args, BLOCK_M=MAX_M, BLOCK_N=config.block_n, num_stages=config.num_stages, **common)
    else:
        sub = config.block_k if block_size is None else min(config.block_k, qblock_k)
        _fp8_gemv_kernel[(triton.cdiv(n, config.block_n),)](
            *args, BLOCK_M=config.block_m, BLOCK_N=config.block_n, SUB=sub, **common)
    return out
