"""The one-row FP8 GEMV with half-precision products: y = x (q * s)^T (+ b) for one row of x
(decode at batch 1) and an FP8 weight q [N, K] with float32 scales s per 128x128 block or per output
channel; the same contract as triton_fp8_few_rows.py's GEMV (its twin: fp8_reference.fp8_linear_torch).

Why another GEMV: at one row the weight's bytes bound the step, and the float32 GEMV spends ~3.4-3.9
sm_90 instructions on every weight (e4m3 pair -> f16 pair, f16 -> f32, a float32 FMA). sm_90 has a
packed half FMA (HFMA2: two weights an instruction) and converts an e4m3 pair to an f16 pair in one,
so here the products are summed in fp16 pairs: about 1.4-1.8 instructions a weight in the loop.
Read from sm_90 builds (docs/perf-log.md, the entry that introduced this file).

fp16 has a narrow range (65504) where bf16 x and the block scales have float32's, so x is brought
into it by a power of two per program (exact: no mantissa bit changes):
  1. before the loop a program finds the largest |x| over its slice of K (and with block scales
     the largest scale of its scales rows), `big`;
  2. x s is multiplied by 2^shift with shift chosen from big's exponent so that every |x s 2^shift|
     stays below 2^max_exp, where the launcher picks max_exp so that one lane's sum over the slice's
     tiles, at most 448 (e4m3's largest value) x 2^max_exp a tile, stays within fp16;
  3. each lane accumulates its products over the tiles in fp16 ([BLOCK_N, BLOCK_K] of them, one
     HFMA2 for two weights); after the last tile the lanes are summed in float32 and multiplied by
     2^-shift.
What it costs in accuracy: x s is rounded to fp16 (11 significant bits, against bf16's 8, for values
down to 2^-14 of the range; smaller ones keep fewer bits: they are 2^18 below the row's largest), and
each lane's running sum rounds to fp16 once a tile (K / BLOCK_K times). Both are far below an e4m3
weight's own rounding (4 significant bits) and of the order of the bf16 output's.

A program owns BLOCK_N rows of W (all inside one block row of the scales; with `gated` BLOCK_N / 2
gate rows and the same up rows, loaded as two tiles, each with its own scales row) over the s-th of
SPLIT slices of K, in [BLOCK_N, BLOCK_K] tiles that Triton lays out as 16 contiguous bytes of a row
a thread (BLOCK_K / 16 threads along K, the rest of the program's threads along the rows, each
thread holding several rows), so x's conversion is shared by the rows a thread holds. The first tile
is requested before waiting for the kernel before (programmatic dependent launch: ops/common/pdl.py)
and the loop starts after it (an FP8 tile carried across the loop would be unpacked to a byte a
register and repacked every tile). Rows past N read the last row (no masked load) and are not
stored; EVEN_K (every slice whole tiles: every Llama / DeepSeek shape) drops the K masks. Split
slices and the epilogue (per-channel scales, bias, silu(gate) * up, split partials summed in split
order by the last split) are the other few-row kernels' (triton_fp8_epilogue.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from foretell.ops.common.pdl import launch_options, let_next_kernel_launch, pdl_enabled, wait_for_previous_kernel
from foretell.ops.gemm.triton_fp8_epilogue import finish_split

FP16_MAX = 65504.0
E4M3_MAX = 448.0
HALF_X_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Fp8HalfGemvConfig:
    block_n: int  # rows of W per program (even when gated; within one block row of the scales)
    block_k: int  # columns per tile: 16 bytes a thread along K
    num_warps: int
    split: int = 1  # slices of K, each its own program

    def __str__(self) -> str:
        return f"fp8 half gemv BN{self.block_n} BK{self.block_k} w{self.num_warps} split{self.split}"


# Candidates for the H200's in-graph sweep (rows of W, columns a tile, warps, splits of K): 16 columns a
# thread along K; BLOCK_K x N x split / SMs bytes are in flight a multiprocessor, and the tiles a slice
# holds amortise the program's x pass and its lanes' final sum (sm_90 counts and the sweep's times:
# docs/perf-log.md). The default first.
HALF_GEMV_CANDIDATES = ((16, 1024, 4, 1), (32, 1024, 8, 1), (16, 2048, 8, 1), (8, 2048, 4, 1), (16, 1024, 4, 2),
                        (32, 1024, 4, 1), (8, 1024, 2, 1), (16, 512, 2, 1), (32, 512, 4, 1), (16, 512, 2, 2))


def half_gemv_config(n: int, k: int, block_n: int | None = None, block_k: int | None = None,
                     num_warps: int | None = None, split: int = 1) -> Fp8HalfGemvConfig:
    """The default at one row: 16 rows x 1024 columns over four warps (8 rows and 16 columns a
    thread), the H200's in-graph sweep's winner at each of Llama-8B's four linears (0566980; the
    times, and the slower 256-column tiles and single warps: docs/perf-log.md, twenty-seventh GPU
    session)."""
    if n < 1 or k < 1:
        raise ValueError(f"FP8 half GEMV needs N >= 1 and K >= 1, got N={n}, K={k}")
    block_k = max(16, min(block_k or 1024, triton.next_power_of_2(k)))
    return Fp8HalfGemvConfig(block_n or 16, block_k, num_warps or 4, split)


def max_exponent(num_tiles: int) -> int:
    """The largest e such that num_tiles products of at most 448 x 2^e sum within fp16."""
    return math.floor(math.log2(FP16_MAX / E4M3_MAX / max(1, num_tiles)))


@triton.jit
def power_of_two(e):
    """2^e as float32, exactly (e an int32 tensor or scalar in [-126, 127])."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def exponent_of(v):
    """e with v in [2^e, 2^(e + 1)) for v > 0 normal float32 (-127 for 0)."""
    return ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def row_shifts(x_tile, lanes, k_end, x_ok, k_per_split, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per row of x (x_tile [BLOCK_K, BLOCK_M] at a slice's first columns `lanes`): the power of two
    (exponent) that puts the row's largest |x| over the slice in [2^13, 2^14), so bf16 x becomes fp16
    exactly (8 significant bits within fp16's 11, values down to 2^-27 of the largest) with room below
    fp16's largest (65504) for tensor-core products accumulated in float32."""
    largest = tl.zeros([BLOCK_K, BLOCK_M], tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        x = tl.load(x_tile + k0, mask=((k0 + lanes) < k_end)[:, None] & x_ok[None, :], other=0.0)
        largest = tl.maximum(largest, tl.abs(x.to(tl.float32)))
    return tl.minimum(tl.maximum(13 - exponent_of(tl.max(largest, axis=0)), -126), 126)


@triton.jit
def _x_shift(x_ptr, scale_a, scale_b, k_start, k_end, k_per_split, max_exp,
             QBLOCK_K: tl.constexpr, PER_CHANNEL: tl.constexpr, S_SPAN: tl.constexpr, BLOCK_K: tl.constexpr):
    """The power of two (its exponent) that keeps |x s 2^shift| below 2^max_exp over the slice:
    x's largest magnitude there, times the largest scale of the two scales rows (block scales)."""
    lanes = k_start + tl.arange(0, BLOCK_K)
    largest = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        x = tl.load(x_ptr + k0 + lanes, mask=(k0 + lanes) < k_end, other=0.0).to(tl.float32)
        largest = tl.maximum(largest, tl.abs(x))
    big = tl.max(largest, axis=0)
    if not PER_CHANNEL:
        blocks = k_start // QBLOCK_K + tl.arange(0, S_SPAN)
        block_ok = blocks < tl.cdiv(k_end, QBLOCK_K)
        scales = tl.maximum(tl.load(scale_a + blocks, mask=block_ok, other=0.0),
                            tl.load(scale_b + blocks, mask=block_ok, other=0.0))
        big *= tl.max(scales, axis=0)
    return tl.minimum(tl.maximum(max_exp - exponent_of(big) - 1, -126), 126)  # big in [2^e, 2^(e + 1))


@triton.jit
def _half_x(x_ptr, cols, k_end, scale_row, factor, QBLOCK_K: tl.constexpr, PER_CHANNEL: tl.constexpr,
            EVEN_K: tl.constexpr):
    """x[cols] s 2^shift as fp16 [BLOCK_K] (its block's scale per column unless PER_CHANNEL)."""
    if EVEN_K:
        x = tl.load(x_ptr + cols).to(tl.float32) * factor
        if not PER_CHANNEL:
            x *= tl.load(scale_row + cols // QBLOCK_K)
    else:
        col_ok = cols < k_end
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) * factor
        if not PER_CHANNEL:
            x *= tl.load(scale_row + cols // QBLOCK_K, mask=col_ok, other=0.0)
    return x.to(tl.float16)


@triton.jit
def _load_tile(tile_ptr, cols, k_end, EVEN_K: tl.constexpr):
    """A [rows, BLOCK_K] FP8 tile at columns `cols` (rows all readable)."""
    if EVEN_K:
        return tl.load(tile_ptr, eviction_policy="evict_first")
    return tl.load(tile_ptr, mask=(cols < k_end)[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _fp8_gemv_half_kernel(
    x_ptr,  # [1, K] fp16 / bf16, unit column stride
    w_ptr,  # [N, K] float8e4nv, contiguous
    scale_ptr,  # [ceil(N / QBLOCK_N), ceil(K / QBLOCK_K)] float32 (PER_CHANNEL: [N, 1])
    bias_ptr,  # [N] (unread without HAS_BIAS)
    out_ptr,  # [1, N] contiguous ([1, N // 2] with GATED), x's dtype or float32
    partial_ptr,  # [SPLIT, 1, N] float32 (unused when SPLIT == 1)
    counter_ptr,  # [>= programs along N] int32, zero (unused when SPLIT == 1)
    N,
    K,
    stride_scale,
    k_per_split,  # a multiple of BLOCK_K
    max_exp,  # max_exponent(tiles a slice holds)
    QBLOCK_N: tl.constexpr,
    QBLOCK_K: tl.constexpr,  # unused with PER_CHANNEL
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,  # W is [gate; up] (N = 2I rows): out [1, I] = silu(x gate^T) * (x up^T)
    PDL: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,  # every slice is whole tiles inside K
    S_SPAN: tl.constexpr,  # a power of two >= the scale blocks a slice spans
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    cols = k_start + tl.arange(0, BLOCK_K)
    # The program's rows: BLOCK_N of W, or BLOCK_N // 2 gate rows and their up rows (GATED).
    PART: tl.constexpr = BLOCK_N // 2 if GATED else BLOCK_N
    half = N // 2 if GATED else N
    first = tile * PART
    part_rows = tl.minimum(first + tl.arange(0, PART), half - 1)  # past the end: the last row, not stored
    a_tile = w_ptr + part_rows[:, None].to(tl.int64) * K + cols[None, :]  # [PART, BLOCK_K]
    b_tile = a_tile + half.to(tl.int64) * K  # the up rows (GATED)
    scale_a = scale_ptr + (first // QBLOCK_N) * stride_scale
    scale_b = scale_ptr + ((half + first) // QBLOCK_N) * stride_scale if GATED else scale_a
    # W is streamed once and no kernel of a step writes it: requested before the wait (pdl.py).
    w_a = _load_tile(a_tile, cols, k_end, EVEN_K)
    if GATED:
        w_b = _load_tile(b_tile, cols, k_end, EVEN_K)
    wait_for_previous_kernel(PDL)
    shift = _x_shift(x_ptr, scale_a, scale_b, k_start, k_end, k_per_split, max_exp,
                     QBLOCK_K, PER_CHANNEL, S_SPAN, BLOCK_K)
    factor = power_of_two(shift)
    acc_a = w_a.to(tl.float16) * _half_x(x_ptr, cols, k_end, scale_a, factor, QBLOCK_K, PER_CHANNEL, EVEN_K)[None, :]
    if GATED:
        acc_b = w_b.to(tl.float16) * _half_x(x_ptr, cols, k_end, scale_b, factor, QBLOCK_K, PER_CHANNEL,
                                             EVEN_K)[None, :]
    for k0 in range(BLOCK_K, k_per_split, BLOCK_K):
        w_a = _load_tile(a_tile + k0, k0 + cols, k_end, EVEN_K)
        if GATED:
            w_b = _load_tile(b_tile + k0, k0 + cols, k_end, EVEN_K)
        x_a = _half_x(x_ptr, k0 + cols, k_end, scale_a, factor, QBLOCK_K, PER_CHANNEL, EVEN_K)  # [BLOCK_K] fp16
        acc_a += w_a.to(tl.float16) * x_a[None, :]  # [PART, BLOCK_K]: a packed half FMA for two weights
        if GATED:
            if PER_CHANNEL:
                x_b = x_a
            else:
                x_b = _half_x(x_ptr, k0 + cols, k_end, scale_b, factor, QBLOCK_K, PER_CHANNEL, EVEN_K)
            acc_b += w_b.to(tl.float16) * x_b[None, :]
    let_next_kernel_launch(PDL)
    unshift = power_of_two(-shift)
    sums = tl.sum(acc_a.to(tl.float32), axis=1) * unshift  # [PART]
    if GATED:  # (gate j, up j) pairs, as program_rows_of_w orders the rows
        sums = tl.interleave(sums, tl.sum(acc_b.to(tl.float32), axis=1) * unshift)  # [BLOCK_N]
    lanes = tl.arange(0, BLOCK_N)
    if GATED:
        acts = first + lanes // 2
        rows, row_ok = tl.where(lanes % 2 == 0, acts, half + acts), acts < half
    else:
        rows = first + lanes
        row_ok = rows < N
    one = tl.arange(0, 1)
    finish_split(tl.trans(sums[None, :]), partial_ptr, counter_ptr, scale_ptr, stride_scale, bias_ptr, out_ptr,
                  rows, row_ok, one, one < 1, tile, split, 1, N, PER_CHANNEL, HAS_BIAS, GATED, SPLIT, BLOCK_N, 1,
                  x_ptr.dtype.element_ty)


def launch_fp8_gemv_half(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         block_size: tuple[int, int] | None, bias: torch.Tensor | None, out: torch.Tensor,
                         config: Fp8HalfGemvConfig, gated: bool, counters) -> None:
    """Launch the kernel for x [1, K] into out (inputs checked by the caller:
    triton_fp8_few_rows.fp8_few_rows_linear); counters: the split counters (SplitCounters)."""
    n, k = weight.shape
    qblock_n, qblock_k = block_size if block_size is not None else (1, 1)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split), config.block_k) * config.block_k
    split = triton.cdiv(k, k_per_split)  # no empty slice
    tiles = triton.cdiv(n // 2 if gated else n, config.block_n // 2 if gated else config.block_n)
    if split > 1:
        partials = torch.empty((split, 1, n), dtype=torch.float32, device=x.device)
        counter_buf = counters.get(x.device, tiles)
    else:
        partials = counter_buf = out  # unread
    pdl = pdl_enabled(x)
    s_span = triton.next_power_of_2(triton.cdiv(k_per_split, qblock_k) + 1) if block_size is not None else 1
    _fp8_gemv_half_kernel[(tiles, split)](
        x, weight, weight_scale, bias if bias is not None else out, out, partials, counter_buf, n, k,
        weight_scale.stride(0), k_per_split, max_exponent(k_per_split // config.block_k),
        QBLOCK_N=qblock_n, QBLOCK_K=qblock_k, PER_CHANNEL=block_size is None, HAS_BIAS=bias is not None,
        GATED=gated, PDL=pdl, SPLIT=split, EVEN_K=split * k_per_split == k, S_SPAN=s_span,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps, **launch_options(pdl),
    )
