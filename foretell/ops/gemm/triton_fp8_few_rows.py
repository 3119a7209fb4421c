"""FP8-weight linears for a few rows: y = x (q * s)^T (+ b) for x [M, K] (1 <= M <= 16) and an FP8
weight q [N, K] with its float32 scales s, per 128x128 block (DeepSeek-V3 / Kimi-K2 checkpoints) or
per output channel (`quantization="fp8"`); layouts in fp8_reference.py, which holds the twin
(fp8_linear_torch).

Decode, verify and draft steps read every weight once for a handful of rows, so they are bound by
the weight bytes: these kernels read the weight in its 8 bits and scale it in-kernel, with no
activation quantization (the result is the dequantized weight's product, as the CPU path computes
it): the GEMV and the MMA sum in float32, the half GEMV in fp16 pairs per lane.

  HALF GEMV (one row of fp16 / bf16 x, Fp8HalfGemvConfig: decode at batch 1, the default there):
    products summed in fp16 pairs, x brought into fp16's range by a power of two
    (triton_fp8_gemv_half.py, which says why and what it costs in accuracy).
  GEMV (up to 4 rows, Fp8GemvConfig: float32 x, and one row of fp16 / bf16 x where the half GEMV's
    tile would straddle a scale block): program (p, s) owns BLOCK_N rows of W over the s-th of SPLIT
    slices of K, in [BLOCK_N, BLOCK_K] tiles, as ops/gemm/triton_gemv.py (whose bf16 tiles run the
    H200's Llama-8B decode at batch 1). A program's rows lie in one 128-row block (two with `gated`:
    gate rows and up rows), so per column block the scale is one number per block row: the kernel
    multiplies x's columns by their block's scale (one multiply per column of x, not per weight) and
    sums w * (x s) over the tile with no per-block reshape. Per-channel scales multiply each row's
    sum once, in the epilogue. At one row of x the products stay per lane [BLOCK_N, BLOCK_K] and are
    summed across the program's threads once, after the last tile (a sum across warps every tile
    cost a quarter of the loop's instructions for sm_90), and `gated` reads its gate rows and up
    rows as two tiles, each with its own scales row (one interleaved tile chose a scale per weight,
    and ran slower than the plain product on the H200).
  MMA (up to 16 rows, fp16 / bf16 x, Fp8MmaConfig; the kernel in triton_fp8_mma.py): program (p, s)
    owns 64 rows of W (one wgmma tile) and the s-th slice of K, and multiplies [64, BLOCK_K] weight
    tiles, converted in registers (exact: every e4m3 value is a bf16 and an fp16 value), by x^T
    tiles [BLOCK_K, 16] on tensor cores; with BLOCK_K dividing the quant block's width, each tile's
    float32 product is scaled by one scale per row of W before it is added. The dot runs in fp16
    (`half_x`, the default): sm_90 turns an e4m3 pair into an f16 pair in one instruction but
    reaches bf16 only through float32, so each row of x is first multiplied by a power of two that
    puts its largest |x| over the slice in [2^13, 2^14) (triton_fp8_gemv_half.row_shifts; a pass
    over x before the loop) and becomes fp16 exactly (a bf16 value's 8 significant bits fit fp16's
    11 down to 2^-27 of the row's largest); the float32 sums are divided by it after the loop.
    half_x=False dots in x's own dtype.

Split-K (both kernels, `split` > 1: layers with fewer programs than the device has
multiprocessors, Llama-8B's o and down projections at M > 1): each split stores a float32 partial;
the split arriving last at its tile's counter (acquire-release) sums the partials in split order
(the same result whichever finished first), applies the epilogue and zeroes the counter, as
ops/gemm/triton_mma.py does. `gated` (W = [gate; up] of an MLP): programs own (gate j, up j) row
pairs and store silu(gate) * up with SiluAndMul's roundings (no gate_up tensor, no launch).

Both request their first weight tile before waiting for the kernel before them and let the next
kernel launch once their reads are done (programmatic dependent launch, ops/common/pdl.py). Grids
depend only on shapes, partials are a torch.empty and the counters are allocated at the first
(eager) launch, so calls can be captured in CUDA graphs. gemv_config / mma_config are the defaults;
candidate_configs lists what scripts/sweep_linears_in_graph_gpu.py --families fp8 times on the H200.

This module imports triton: only ops/gemm/fp8_dispatch.py imports it, on CUDA (and the
interpreter tests, tests/ops/test_gemm_fp8.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from foretell.ops.common.pdl import launch_options, let_next_kernel_launch, pdl_enabled, wait_for_previous_kernel
from foretell.ops.common.split_counters import SplitCounters
from foretell.ops.gemm.fp8_reference import check_fp8_weight
from foretell.ops.gemm.triton_fp8_epilogue import finish_split
from foretell.ops.gemm.triton_fp8_gemv_half import (HALF_GEMV_CANDIDATES, HALF_X_DTYPES, Fp8HalfGemvConfig,
                                                    half_gemv_config, launch_fp8_gemv_half)
from foretell.ops.gemm.triton_fp8_mma import MAX_M, MMA_BLOCK_N, Fp8MmaConfig, _fp8_mma_kernel, _mma_stages, mma_config
from foretell.ops.gemm.triton_gemv import program_rows_of_w
from foretell.ops.gemm.triton_mma import device_limits

GEMV_MAX_M = 4
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MMA_X_DTYPES = (torch.bfloat16, torch.float16)
GEMV_TILE_BYTES = 8192  # bytes of FP8 a GEMV tile reads at one row of x (64 a thread over 4 warps)
# A counter per program tile, zero between launches (one set per process, as triton_mma.py's).
_COUNTERS = SplitCounters(min_count=1 << 16)


@dataclass(frozen=True)
class Fp8GemvConfig:
    block_m: int  # power of two >= M
    block_n: int  # rows of W per program (even when gated)
    block_k: int  # columns of W per tile (power of two)
    num_warps: int
    split: int = 1  # slices of K, each its own program

    def __str__(self) -> str:
        return f"fp8 gemv BM{self.block_m} BN{self.block_n} BK{self.block_k} w{self.num_warps} split{self.split}"




def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def kernel_block_ok(block_size: tuple[int, int] | None) -> bool:
    """The kernels take per-channel scales, or blocks whose width is a power of two (every
    published checkpoint: 128 x 128); other widths go to the torch twin."""
    return block_size is None or (block_size[1] & (block_size[1] - 1)) == 0


def gemv_config(m: int, n: int, k: int, block_k: int | None = None, block_n: int | None = None,
                num_warps: int | None = None, split: int = 1, device: torch.device | None = None) -> Fp8GemvConfig:
    """At one row of x: the winners of the H200's in-graph sweep (scripts/sweep_linears_in_graph_gpu.py,
    2026-12-02 at 5b0b5ca: all 32 layers' linears of a Llama-8B decode step in one CUDA graph, each
    layer kind's tile swapped against the others), which overturned the isolated, L2-flushed sweep's
    (b3ec0f8) for o and down. Eight rows of W a program, sixteen where that still leaves eight
    programs a multiprocessor (gate_up 28672: 1792 programs); 8 KiB of FP8 a tile over four warps,
    halved to 4 KiB where eight rows leave four programs a multiprocessor or more (qkv 6144: 768):
        qkv 6144 x 4096      8 x 512    (was 8 x 1024)
        o 4096 x 4096        8 x 1024   (was 4 x 2048)
        gate_up 28672 x 4096 16 x 512   (was 8 x 1024)
        down 4096 x 14336    8 x 1024   (was 4 x 2048)
    each faster in the graph than the tile it replaced (the times: docs/perf-log.md, "eighteenth GPU
    session"). More rows of x keep four rows of W and 4096 / M columns (their products all sit in
    registers at once), still four warps (eight ran much slower at M = 4: docs/perf-log.md,
    "Figures moved from docstrings")."""
    if not 1 <= m <= GEMV_MAX_M or n < 1 or k < 1:
        raise ValueError(f"FP8 GEMV needs 1 <= M <= {GEMV_MAX_M}, N >= 1, K >= 1; got M={m}, N={n}, K={k}")
    block_m = _next_pow2(m)
    sms, _ = device_limits(device or torch.device("cpu"))
    if block_n is None:
        block_n = (16 if triton.cdiv(n, 16) >= 8 * sms else 8) if m == 1 else 4
    if block_k is None:
        tile_bytes = GEMV_TILE_BYTES // 2 if block_n == 8 and triton.cdiv(n, 8) >= 4 * sms else GEMV_TILE_BYTES
        block_k = min(_next_pow2(k), tile_bytes // block_n if m == 1 else GEMV_TILE_BYTES // 2 // block_m)
    block_k = max(16, block_k)
    return Fp8GemvConfig(block_m, block_n, block_k, num_warps or 4, split)



def default_config(m: int, n: int, k: int, dtype: torch.dtype, block_size: tuple[int, int] | None,
                   device: torch.device | None = None):
    """The half-precision GEMV for one row of fp16 / bf16 (triton_fp8_gemv_half.py), the float32
    GEMV for a float32 x, the MMA for more rows of fp16 / bf16. The GEMVs' rows of W per program stay
    within one block row (the float32 GEMV's four when eight would not fit the blocks)."""
    if m == 1 and dtype in HALF_X_DTYPES:
        config = half_gemv_config(n, k)
        if gemv_rows_fit_blocks(config.block_n, n, block_size, gated=False):
            return config
    if m == 1 or dtype not in MMA_X_DTYPES:
        config = gemv_config(m, n, k, device=device)
        if not gemv_rows_fit_blocks(config.block_n, n, block_size, gated=False):
            config = gemv_config(m, n, k, block_n=4, device=device)
        return config
    return mma_config(k, block_size, n, device)


# GEMV candidates at one row of x: (rows of W per program, columns per tile, warps, splits of K).
# The first five are neighbours of the in-graph sweep's winners (gemv_config), listed first so that a
# budgeted sweep (--max-candidates) reaches them.
# 16 KiB tiles over four warps (8 x 2048, 16 x 1024: 128 weights a thread) take 3.15 sm_90
# instructions a weight in their loop against 3.59 for 8 KiB ones (x's load and scaling shared by
# twice the rows), and keep twice the bytes in flight; split 2 keeps their program count at N = 4096.
GEMV_CANDIDATES = ((8, 256, 4, 1), (16, 256, 4, 1), (32, 256, 4, 1), (16, 512, 8, 1), (8, 512, 2, 1),
                   (2, 4096, 4, 1), (4, 1024, 4, 1), (4, 2048, 4, 1), (4, 4096, 4, 1), (8, 512, 4, 1),
                   (8, 1024, 4, 1), (8, 1024, 8, 1), (8, 2048, 8, 1), (16, 512, 4, 1), (16, 1024, 8, 1),
                   (4, 2048, 4, 2), (8, 1024, 4, 2), (8, 2048, 4, 1), (16, 1024, 4, 1), (8, 2048, 4, 2),
                   (4, 4096, 4, 2))


def candidate_configs(m: int, n: int, k: int, dtype: torch.dtype, block_size: tuple[int, int] | None,
                      device: torch.device | None = None) -> list:
    """default_config first, then the GEMV tiles, warps and splits (columns per tile shrinking as
    rows of x grow) and the MMA tile widths and splits that the H200 sweep times for this shape.
    The MMA is a candidate at one row of fp16 / bf16 x too (15 of its 16 rows padding): on tensor
    cores a weight costs its conversion and a sixteenth of an MMA, not a float32 FMA, and its tiles
    stream through shared memory several in flight (cp.async stages). Its sm_90 loop at Llama's
    qkv takes 3.4 instructions a weight for fp16 x at 128 columns (2.7 at 256, per channel) and
    4.9 for bf16 x (the weight made bf16 through float32), the GEMV 3.15-3.6."""
    configs = [default_config(m, n, k, dtype, block_size, device)]
    if m == 1 and dtype in HALF_X_DTYPES:
        for block_n, block_k, warps, split in HALF_GEMV_CANDIDATES:
            if block_k <= 2 * _next_pow2(k) and (split == 1 or k // split >= block_k):
                configs.append(half_gemv_config(n, k, block_n, block_k, warps, split))
    if m <= GEMV_MAX_M:
        for block_n, block_k, warps, split in GEMV_CANDIDATES:
            block_k //= _next_pow2(m)
            if block_k <= 2 * _next_pow2(k) and (split == 1 or k // split >= block_k):
                configs.append(gemv_config(m, n, k, block_k, block_n, warps, split))
    if dtype in MMA_X_DTYPES:
        _, smem = device_limits(device or torch.device("cpu"))
        for block_k in (64, 128, 256):
            if block_size is not None and block_size[1] % block_k:
                continue
            for split in (1, 2, 4, 8):
                if k // split >= max(block_k, 256):
                    configs.append(Fp8MmaConfig(block_k, _mma_stages(MMA_BLOCK_N, block_k, smem), split=split))
    return list(dict.fromkeys(configs))


@triton.jit
def _gemv_row(acc, w, x_ptr, cols, k_end, scale_row, QBLOCK_K: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """acc [R, BLOCK_K] + the products of w [R, BLOCK_K] (FP8 at columns `cols`, rows in one block
    row whose scales start at scale_row) with one row of x, x's columns scaled by their block's
    scale (PER_CHANNEL: plain products, scaled in the epilogue)."""
    col_ok = cols < k_end
    x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
    if not PER_CHANNEL:
        x *= tl.load(scale_row + cols // QBLOCK_K, mask=col_ok, other=0.0)
    return acc + w.to(tl.float32) * x[None, :]


@triton.jit
def _gemv_accumulate(acc, w, x_ptr, stride_xm, M, cols, k_end, scale_gate, scale_up,
                     QBLOCK_K: tl.constexpr, PER_CHANNEL: tl.constexpr, GATED: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] + the tile's products: w [BLOCK_N, BLOCK_K] (FP8 at columns `cols`)
    with x[:, cols], x's columns first scaled by their block's scale in the program's block row
    (scale_gate: the scales row of the program's rows; scale_up: of its up rows when GATED);
    PER_CHANNEL: plain sums, scaled in the epilogue."""
    w = w.to(tl.float32)
    col_ok = cols < k_end
    if not PER_CHANNEL:
        s_gate = tl.load(scale_gate + cols // QBLOCK_K, mask=col_ok, other=0.0)  # [BLOCK_K]
        if GATED:
            s_up = tl.load(scale_up + cols // QBLOCK_K, mask=col_ok, other=0.0)  # [BLOCK_K]
            is_gate = (tl.arange(0, BLOCK_N) % 2) == 0  # rows of the program: (gate j, up j) pairs
    if BLOCK_M == 1:
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
        if PER_CHANNEL:
            xs = x[None, :]
        elif GATED:
            xs = tl.where(is_gate[:, None], (x * s_gate)[None, :], (x * s_up)[None, :])  # [BLOCK_N, BLOCK_K]
        else:
            xs = (x * s_gate)[None, :]
        return acc + w * xs  # [BLOCK_N, BLOCK_K]: summed across the lanes once, after the last tile
    else:
        m = tl.arange(0, BLOCK_M)
        x = tl.load(x_ptr + m[:, None] * stride_xm + cols[None, :], mask=(m < M)[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        if PER_CHANNEL:
            xs = x[:, None, :]
        elif GATED:
            xs = tl.where(is_gate[None, :, None], (x * s_gate[None, :])[:, None, :], (x * s_up[None, :])[:, None, :])
        else:
            xs = (x * s_gate[None, :])[:, None, :]
        return acc + tl.sum(w[None, :, :] * xs, axis=2)  # [BLOCK_M, BLOCK_N]


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [M, K], unit column stride
    w_ptr,  # [N, K] float8e4nv, contiguous
    scale_ptr,  # [ceil(N / QBLOCK_N), ceil(K / QBLOCK_K)] float32 (PER_CHANNEL: [N, 1])
    bias_ptr,  # [N] (unread without HAS_BIAS)
    out_ptr,  # [M, N] contiguous ([M, N // 2] with GATED), x's dtype or float32
    partial_ptr,  # [SPLIT, M, N] float32 (unused when SPLIT == 1)
    counter_ptr,  # [>= programs along N] int32, zero (unused when SPLIT == 1)
    M,
    N,
    K,
    stride_xm,
    stride_scale,
    k_per_split,  # a multiple of BLOCK_K
    QBLOCK_N: tl.constexpr,  # a multiple of BLOCK_N (BLOCK_N // 2 and of N // 2 with GATED)
    QBLOCK_K: tl.constexpr,  # unused with PER_CHANNEL
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,  # W is [gate; up] (N = 2I rows): out [M, I] = silu(x gate^T) * (x up^T)
    PDL: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rows, row_ok = program_rows_of_w(tile, N, BLOCK_N, GATED)  # rows of W = output columns
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    lanes = k_start + tl.arange(0, BLOCK_K)
    if GATED and BLOCK_M == 1:
        # Gate rows and up rows as two tiles [BLOCK_N // 2, BLOCK_K], each with its own block row of
        # scales: no per-weight choice of scale (one interleaved tile was slower at Llama-8B's gate_up).
        acts = tile * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        gate_tile = w_ptr + acts[:, None].to(tl.int64) * K + lanes[None, :]  # [BLOCK_N // 2, BLOCK_K]
        up_tile = gate_tile + (N // 2).to(tl.int64) * K
        act_ok = (acts < N // 2)[:, None]
        w_gate = tl.load(gate_tile, mask=act_ok & (lanes < k_end)[None, :], other=0.0, eviction_policy="evict_first")
        w_up = tl.load(up_tile, mask=act_ok & (lanes < k_end)[None, :], other=0.0, eviction_policy="evict_first")
        wait_for_previous_kernel(PDL)
        scale_gate = scale_ptr + ((tile * (BLOCK_N // 2)) // QBLOCK_N) * stride_scale
        scale_up = scale_ptr + ((N // 2 + tile * (BLOCK_N // 2)) // QBLOCK_N) * stride_scale
        acc_gate = _gemv_row(tl.zeros([BLOCK_N // 2, BLOCK_K], tl.float32), w_gate, x_ptr, lanes, k_end, scale_gate,
                             QBLOCK_K, PER_CHANNEL)
        acc_up = _gemv_row(tl.zeros([BLOCK_N // 2, BLOCK_K], tl.float32), w_up, x_ptr, lanes, k_end, scale_up,
                           QBLOCK_K, PER_CHANNEL)
        for k0 in range(BLOCK_K, k_per_split, BLOCK_K):
            k_ok = ((k0 + lanes) < k_end)[None, :]
            w_gate = tl.load(gate_tile + k0, mask=act_ok & k_ok, other=0.0, eviction_policy="evict_first")
            w_up = tl.load(up_tile + k0, mask=act_ok & k_ok, other=0.0, eviction_policy="evict_first")
            acc_gate = _gemv_row(acc_gate, w_gate, x_ptr, k0 + lanes, k_end, scale_gate, QBLOCK_K, PER_CHANNEL)
            acc_up = _gemv_row(acc_up, w_up, x_ptr, k0 + lanes, k_end, scale_up, QBLOCK_K, PER_CHANNEL)
        let_next_kernel_launch(PDL)
        acc = tl.interleave(tl.sum(acc_gate, axis=1), tl.sum(acc_up, axis=1))[None, :]  # [1, BLOCK_N]: (gate j, up j)
    else:
        w_tile = w_ptr + rows[:, None].to(tl.int64) * K + lanes[None, :]  # [BLOCK_N, BLOCK_K] at k_start
        # W is streamed once and no kernel of a step writes it: requested before the wait (pdl.py).
        w = tl.load(w_tile, mask=row_ok[:, None] & (lanes < k_end)[None, :], other=0.0, eviction_policy="evict_first")
        wait_for_previous_kernel(PDL)
        # The scales row of the program's rows (its up rows' too when GATED): one block row each.
        if GATED:
            first = tile * (BLOCK_N // 2)
            scale_gate = scale_ptr + (first // QBLOCK_N) * stride_scale
            scale_up = scale_ptr + ((N // 2 + first) // QBLOCK_N) * stride_scale
        else:
            scale_gate = scale_ptr + ((tile * BLOCK_N) // QBLOCK_N) * stride_scale
            scale_up = scale_gate
        # One row of x: products kept per lane [BLOCK_N, BLOCK_K] and summed across the program's threads
        # once after the last tile (a sum across warps every tile cost barriers and shared memory);
        # more rows: [BLOCK_M, BLOCK_N] sums, their products being BLOCK_M times the registers.
        acc = tl.zeros([BLOCK_N, BLOCK_K] if BLOCK_M == 1 else [BLOCK_M, BLOCK_N], tl.float32)
        acc = _gemv_accumulate(acc, w, x_ptr, stride_xm, M, lanes, k_end, scale_gate, scale_up,
                               QBLOCK_K, PER_CHANNEL, GATED, BLOCK_M, BLOCK_N)
        for k0 in range(BLOCK_K, k_per_split, BLOCK_K):
            w = tl.load(w_tile + k0, mask=row_ok[:, None] & ((k0 + lanes) < k_end)[None, :], other=0.0,
                        eviction_policy="evict_first")
            acc = _gemv_accumulate(acc, w, x_ptr, stride_xm, M, k0 + lanes, k_end, scale_gate, scale_up,
                                   QBLOCK_K, PER_CHANNEL, GATED, BLOCK_M, BLOCK_N)
        let_next_kernel_launch(PDL)
        if BLOCK_M == 1:
            acc = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
    m = tl.arange(0, BLOCK_M)
    finish_split(tl.trans(acc), partial_ptr, counter_ptr, scale_ptr, stride_scale, bias_ptr, out_ptr, rows, row_ok,
                  m, m < M, tile, split, M, N, PER_CHANNEL, HAS_BIAS, GATED, SPLIT, BLOCK_N, BLOCK_M,
                  x_ptr.dtype.element_ty)




def check_few_rows_inputs(x, weight, weight_scale, block_size, bias, max_m: int, dtypes, gated: bool = False) -> None:
    """Raise a ValueError naming what is wrong unless the few-row kernels can take these."""
    check_fp8_weight(weight, weight_scale, block_size)
    if not kernel_block_ok(block_size):
        raise ValueError(f"the FP8 kernels take blocks of a power-of-two width, got block_size {block_size}")
    n, k = weight.shape
    if gated and n % 2:
        raise ValueError(f"a gated weight is [gate; up] with an even number of rows, got {list(weight.shape)}")
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


def gemv_rows_fit_blocks(block_n: int, n: int, block_size: tuple[int, int] | None, gated: bool) -> bool:
    """Whether every GEMV program's rows of W lie in one block row (gate rows in one and up rows
    in one when gated), which its scaling of x by column block needs."""
    if block_size is None:
        return True
    rows_per_part = block_n // 2 if gated else block_n
    return block_size[0] % rows_per_part == 0 and (not gated or (n // 2) % rows_per_part == 0)


def fp8_few_rows_linear(
    x: torch.Tensor,  # [M, K], 1 <= M <= 16; any row stride
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, contiguous ([gate; up] when gated)
    weight_scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] or [N, 1] float32, contiguous
    block_size: tuple[int, int] | None,  # None: per-channel scales
    bias: torch.Tensor | None = None,  # [N], x's dtype
    config: Fp8GemvConfig | Fp8MmaConfig | None = None,  # None: default_config's choice
    float32_out: bool = False,  # the values rounded to x's dtype, stored as float32
    gated: bool = False,  # silu(gate) * up of the product (SiluAndMul's roundings), [M, N // 2]
) -> torch.Tensor:  # [M, N] contiguous ([M, N // 2] when gated), x's dtype (or float32)
    """fp8_linear_torch(x, weight, weight_scale, block_size, bias) reading the FP8 weight once."""
    m = x.shape[0] if x.dim() == 2 else 0
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    if config is None and 1 <= m <= MAX_M:
        config = default_config(m, n, k, x.dtype, block_size, x.device)
    if isinstance(config, Fp8HalfGemvConfig):
        return _half_gemv_linear(x, weight, weight_scale, block_size, bias, config, float32_out, gated)
    mma = isinstance(config, Fp8MmaConfig)
    check_few_rows_inputs(x, weight, weight_scale, block_size, bias, MAX_M if mma else GEMV_MAX_M,
                          MMA_X_DTYPES if mma else X_DTYPES, gated)
    qblock_n, qblock_k = block_size if block_size is not None else (1, 1)
    if mma and block_size is not None and qblock_k % config.block_k:
        raise ValueError(f"config {config}: block_k must divide the quant block's width {qblock_k}")
    if not mma and config.block_m < m:
        raise ValueError(f"config {config} has block_m {config.block_m} < M={m}")
    if gated and config.block_n % 2:
        raise ValueError(f"config {config}: a gated product needs an even block_n (gate, up pairs)")
    if not mma and not gemv_rows_fit_blocks(config.block_n, n, block_size, gated):
        raise ValueError(f"config {config}: a program's rows of W must lie in one block row of {block_size}"
                         f"{' (gate and up rows each)' if gated else ''}")
    if config.split < 1:
        raise ValueError(f"config {config}: split must be >= 1")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((m, n // 2 if gated else n), dtype=torch.float32 if float32_out else x.dtype, device=x.device)
    tiles = triton.cdiv(n, config.block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split), config.block_k) * config.block_k
    split = triton.cdiv(k, k_per_split)  # no empty slice
    if split > 1:
        partials = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = _COUNTERS.get(x.device, tiles)
    else:
        partials = counters = out  # unread
    pdl = pdl_enabled(x)
    args = (x, weight, weight_scale, bias if bias is not None else out, out, partials, counters, m, n, k, x.stride(0),
            weight_scale.stride(0), k_per_split)
    common = dict(QBLOCK_N=qblock_n, QBLOCK_K=qblock_k, PER_CHANNEL=block_size is None, HAS_BIAS=bias is not None,
                  GATED=gated, PDL=pdl, SPLIT=split, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                  num_warps=config.num_warps, **launch_options(pdl))
    if mma:
        _fp8_mma_kernel[(tiles, split)](*args, BLOCK_M=MAX_M, num_stages=config.num_stages,
                                        HALF_X=config.half_x, **common)
    else:
        _fp8_gemv_kernel[(tiles, split)](*args, BLOCK_M=config.block_m, **common)
    return out


def _half_gemv_linear(x, weight, weight_scale, block_size, bias, config: Fp8HalfGemvConfig, float32_out: bool,
                      gated: bool) -> torch.Tensor:
    """fp8_few_rows_linear on the half-precision GEMV (one row of fp16 / bf16 x)."""
    check_few_rows_inputs(x, weight, weight_scale, block_size, bias, 1, HALF_X_DTYPES, gated)
    n = weight.shape[0]
    if gated and config.block_n % 2:
        raise ValueError(f"config {config}: a gated product needs an even block_n (gate, up pairs)")
    if not gemv_rows_fit_blocks(config.block_n, n, block_size, gated):
        raise ValueError(f"config {config}: a program's rows of W must lie in one block row of {block_size}"
                         f"{' (gate and up rows each)' if gated else ''}")
    if config.split < 1:
        raise ValueError(f"config {config}: split must be >= 1")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((1, n // 2 if gated else n), dtype=torch.float32 if float32_out else x.dtype, device=x.device)
    launch_fp8_gemv_half(x, weight, weight_scale, block_size, bias, out, config, gated, _COUNTERS)
    return out
