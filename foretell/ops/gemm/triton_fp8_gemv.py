"""The FP8 few-row GEMV (triton_fp8_few_rows.py's kernel for up to 4 rows: float32 x, and one row of
fp16 / bf16 x where the half GEMV's tile would straddle a scale block), its config (Fp8GemvConfig,
gemv_config) and the tiles the H200 sweep times (GEMV_CANDIDATES). triton_fp8_few_rows.py's
docstring says more (split-K, `gated`, programmatic dependent launch); it dispatches here and checks
the inputs.

Program (p, s) owns BLOCK_N rows of W over the s-th of SPLIT slices of K, in [BLOCK_N, BLOCK_K]
tiles, as ops/gemm/triton_gemv.py (whose bf16 tiles run the H200's Llama-8B decode at batch 1). A
program's rows lie in one 128-row block (two with `gated`: gate rows and up rows), so per column
block the scale is one number per block row: the kernel multiplies x's columns by their block's
scale (one multiply per column of x, not per weight) and sums w * (x s) over the tile with no
per-block reshape. Per-channel scales multiply each row's sum once, in the epilogue. At one row of
x the products stay per lane [BLOCK_N, BLOCK_K] and are summed across the program's threads once,
after the last tile (a sum across warps every tile cost a quarter of the loop's instructions for
sm_90), and `gated` reads its gate rows and up rows as two tiles, each with its own scales row (one
interleaved tile chose a scale per weight, and ran slower than the plain product on the H200).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from foretell.ops.common.pdl import let_next_kernel_launch, wait_for_previous_kernel
from foretell.ops.gemm.triton_fp8_epilogue import finish_split
from foretell.ops.gemm.triton_gemv import program_rows_of_w
from foretell.ops.gemm.triton_mma import device_limits

GEMV_MAX_M = 4
GEMV_TILE_BYTES = 8192  # bytes of FP8 a GEMV tile reads at one row of x (64 a thread over 4 warps)


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
