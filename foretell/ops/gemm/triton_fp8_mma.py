"""The FP8 few-row MMA (triton_fp8_few_rows.py's kernel for 2 to 16 rows of fp16 / bf16 x, the verify
and draft steps): program (p, s) owns 64 rows of W (one wgmma tile) and the s-th slice of K and
multiplies [64, BLOCK_K] FP8 weight tiles, converted in registers, by x^T tiles [BLOCK_K, 16] on
tensor cores, each tile's float32 product scaled by one scale per row of W; the dot runs in fp16
(`half_x`: each row of x times a power of two is fp16 exactly, so a weight needs one conversion).
triton_fp8_few_rows.py's docstring says more; it dispatches here and checks the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from foretell.ops.common.pdl import let_next_kernel_launch, wait_for_previous_kernel
from foretell.ops.gemm.triton_fp8_epilogue import finish_split
from foretell.ops.gemm.triton_fp8_gemv_half import power_of_two, row_shifts
from foretell.ops.gemm.triton_gemv import program_rows_of_w
from foretell.ops.gemm.triton_mma import device_limits

MAX_M = 16
MMA_BLOCK_N = 64


@dataclass(frozen=True)
class Fp8MmaConfig:
    block_k: int  # columns of W per tile (power of two >= 16; divides the quant block's width)
    num_stages: int = 4
    num_warps: int = 4
    block_n: int = MMA_BLOCK_N
    split: int = 1  # slices of K, each its own program
    half_x: bool = True  # x as fp16 times a power of two per row (exact): one conversion a weight

    def __str__(self) -> str:
        half = "" if self.half_x else " bf16-dot"
        return f"fp8 mma BN{self.block_n} BK{self.block_k} s{self.num_stages} w{self.num_warps} split{self.split}{half}"


def _mma_stages(block_n: int, block_k: int, smem_bytes: int, wanted: int = 4) -> int:
    """Pipeline depth whose shared memory fits: num_stages + 1 FP8 tiles of W and x^T tiles."""
    per_stage = block_n * block_k + MAX_M * block_k * 2
    return max(1, min(wanted, smem_bytes // per_stage - 1))


def mma_config(k: int, block_size: tuple[int, int] | None, n: int | None = None,
               device: torch.device | None = None) -> Fp8MmaConfig:
    """128-column tiles (one scale per row of W per tile for 128-wide blocks), up to 4 in flight;
    given N, split-K doubled (up to 8 ways, each slice at least 512 columns) while the programs stay
    within eight per multiprocessor: the H200 sweep's winners at a 4-row verify (b3ec0f8) split
    Llama-8B's qkv, o and down 8 ways (96, 64, 64 tiles: faster than 2 or 4) and gate_up
    (448 tiles) 2 ways (the figures: docs/perf-log.md, "Figures moved from docstrings")."""
    block_k = min(128, max(16, triton.next_power_of_2(k)))
    if block_size is not None:
        block_k = max(16, min(block_k, block_size[1]))
    sms, smem = device_limits(device or torch.device("cpu"))
    split = 1
    if n is not None:
        tiles = triton.cdiv(n, MMA_BLOCK_N)
        while split < 8 and 2 * split * tiles <= 8 * sms and k // (2 * split) >= 512:
            split *= 2
    return Fp8MmaConfig(block_k, _mma_stages(MMA_BLOCK_N, block_k, smem), split=split)



@triton.jit
def _fp8_mma_kernel(
    x_ptr,  # [M, K] fp16 / bf16, unit column stride
    w_ptr,  # [N, K] float8e4nv, contiguous
    scale_ptr,  # [ceil(N / QBLOCK_N), ceil(K / QBLOCK_K)] float32 (PER_CHANNEL: [N, 1])
    bias_ptr,  # [N] (unread without HAS_BIAS)
    out_ptr,  # [M, N] contiguous ([M, N // 2] with GATED), x's dtype or float32
    partial_ptr,  # [SPLIT, M, N] float32 (unused when SPLIT == 1)
    counter_ptr,  # [>= cdiv(N, BLOCK_N)] int32, zero (unused when SPLIT == 1)
    M,
    N,
    K,
    stride_xm,
    stride_scale,
    k_per_split,  # a multiple of BLOCK_K
    QBLOCK_N: tl.constexpr,
    QBLOCK_K: tl.constexpr,  # a multiple of BLOCK_K (unused with PER_CHANNEL)
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    PDL: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HALF_X: tl.constexpr,  # x taken as fp16 times a power of two per row (row_shifts): exact for bf16
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rows_w, w_ok = program_rows_of_w(tile, N, BLOCK_N, GATED)  # output columns
    rows_x = tl.arange(0, BLOCK_M)
    x_ok = rows_x < M
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    lanes = k_start + tl.arange(0, BLOCK_K)
    w_tile = w_ptr + rows_w[:, None].to(tl.int64) * K + lanes[None, :]  # [BLOCK_N, BLOCK_K]
    x_tile = x_ptr + rows_x[None, :] * stride_xm + lanes[:, None]  # [BLOCK_K, BLOCK_M]
    scale_rows = scale_ptr + (rows_w // QBLOCK_N) * stride_scale  # [BLOCK_N]
    dtype = tl.float16 if HALF_X else x_ptr.dtype.element_ty  # the dot's inputs
    w = tl.load(w_tile, mask=w_ok[:, None] & (lanes < k_end)[None, :], other=0.0, eviction_policy="evict_first")
    wait_for_previous_kernel(PDL)
    if HALF_X:
        shift = row_shifts(x_tile, lanes, k_end, x_ok, k_per_split, BLOCK_K, BLOCK_M)  # [BLOCK_M]
        factor = power_of_two(shift)[None, :]
    x = tl.load(x_tile, mask=(lanes < k_end)[:, None] & x_ok[None, :], other=0.0)
    if HALF_X:
        x = (x.to(tl.float32) * factor).to(tl.float16)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if PER_CHANNEL:
        acc = tl.dot(w.to(dtype), x, acc)
    else:
        acc += tl.dot(w.to(dtype), x) * tl.load(scale_rows + k_start // QBLOCK_K, mask=w_ok, other=0.0)[:, None]
    for k0 in range(BLOCK_K, k_per_split, BLOCK_K):
        k_ok = (lanes + k0) < k_end
        w = tl.load(w_tile + k0, mask=w_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_tile + k0, mask=k_ok[:, None] & x_ok[None, :], other=0.0)
        if HALF_X:
            x = (x.to(tl.float32) * factor).to(tl.float16)
        if PER_CHANNEL:
            acc = tl.dot(w.to(dtype), x, acc)
        else:
            scales = tl.load(scale_rows + (k_start + k0) // QBLOCK_K, mask=w_ok, other=0.0)  # [BLOCK_N]
            acc += tl.dot(w.to(dtype), x) * scales[:, None]
    let_next_kernel_launch(PDL)
    if HALF_X:
        acc *= power_of_two(-shift)[None, :]
    finish_split(acc, partial_ptr, counter_ptr, scale_ptr, stride_scale, bias_ptr, out_ptr, rows_w, w_ok,
                 rows_x, x_ok, tile, split, M, N, PER_CHANNEL, HAS_BIAS, GATED, SPLIT, BLOCK_N, BLOCK_M,
                 x_ptr.dtype.element_ty)
