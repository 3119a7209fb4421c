"""A skinny GEMM for decode: y = x W^T (+ b) for x [M, K] with few rows (M <= 16), W [N, K].

At batch 1 (M = 1) or a verify of k + 1 tokens (M = 4) a linear layer is bound by reading W, so
the kernel is built around that read:
  - program (column block, K split) owns BLOCK_N output columns over one slice of K and reads its
    W rows once, in [BLOCK_N, BLOCK_K] tiles of 16-byte loads, for all M rows of x;
  - it keeps a float32 partial product per (row, column, k lane) and reduces across the k lanes
    once at the end, so the inner loop is loads and FMAs only (no tensor cores: at M <= 16 the
    arithmetic is never the limit, and a GEMV needs no padding of M to 16);
  - columns alone give too few programs for narrow layers (N = 4096 is 256 blocks of 16), so K is
    split: each split writes float32 partial sums into a workspace [split_k, M, N], and a second
    small kernel adds the splits in a fixed order (deterministic, no atomics), adds the bias and
    rounds to x's dtype. With split_k = 1 the first kernel does that itself.

Output: x's dtype, float32 accumulation. Grids depend only on shapes, nothing syncs with the host,
and the output and workspace are torch.empty of a shape fixed by (M, N, K, config), so a call can
be captured in a CUDA graph.

Whether a layer uses this or cuBLAS is decided by layers/small_m_dispatch.py (timed once per
shape on the device); this module imports triton and is imported only on CUDA (or by the
interpreter tests, tests/test_small_m_gemm.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_M = 16
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Per power-of-two row count: (BLOCK_N, BLOCK_K, num_warps). Sized so a thread holds about 64
# float32 partials (BLOCK_M * BLOCK_N * BLOCK_K / (32 * num_warps)); x is re-read once per column
# block (from L2), so BLOCK_N shrinks slowest. First guesses, to be checked on the GPU
# (scripts/bench_small_m_gemm.py); the dispatch times them against cuBLAS before using them.
_TILES = {1: (16, 512, 4), 2: (16, 256, 4), 4: (16, 256, 8), 8: (16, 128, 8), 16: (8, 128, 8)}
_REDUCE_BLOCK = 256


@dataclass(frozen=True)
class SmallMConfig:
    block_m: int  # power of two >= M
    block_n: int
    block_k: int
    split_k: int  # K slices, each a whole number of BLOCK_K tiles
    num_warps: int

    def __str__(self) -> str:  # for logs and benchmark tables
        return f"BM{self.block_m} BN{self.block_n} BK{self.block_k} split{self.split_k} w{self.num_warps}"


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any plausible count
    return torch.cuda.get_device_properties(device).multi_processor_count


def _heuristic_split_k(column_blocks: int, k_tiles: int, num_sms: int) -> int:
    # Enough programs to keep every SM streaming (a few resident per SM), but at least 4 tiles
    # per split so the loop, not the prologue and the workspace, dominates.
    split = 1
    while column_blocks * split < 4 * num_sms and k_tiles // (2 * split) >= 4:
        split *= 2
    return split


def pick_config(m: int, n: int, k: int, num_sms: int = 132, split_k: int | None = None) -> SmallMConfig:
    """The tile sizes for an [m, k] x [n, k]^T product; split_k None: the heuristic's."""
    if not 1 <= m <= MAX_M or n < 1 or k < 1:
        raise ValueError(f"small-M GEMM needs 1 <= M <= {MAX_M}, N >= 1, K >= 1; got M={m}, N={n}, K={k}")
    block_m = _next_pow2(m)
    block_n, block_k, num_warps = _TILES[block_m]
    block_k = min(block_k, max(16, _next_pow2(k)))
    k_tiles = triton.cdiv(k, block_k)
    if split_k is None:
        split_k = _heuristic_split_k(triton.cdiv(n, block_n), k_tiles, num_sms)
    # No empty splits: every split gets the same whole number of tiles, the last maybe fewer.
    tiles_per_split = triton.cdiv(k_tiles, max(1, min(split_k, k_tiles)))
    return SmallMConfig(block_m, block_n, block_k, triton.cdiv(k_tiles, tiles_per_split), num_warps)


def candidate_configs(m: int, n: int, k: int, device: torch.device) -> list[SmallMConfig]:
    """What the dispatch times against cuBLAS: no split, and the heuristic's split."""
    configs = [pick_config(m, n, k, split_k=1), pick_config(m, n, k, _num_sms(device))]
    return list(dict.fromkeys(configs))


@triton.jit
def _small_m_gemm_kernel(
    x_ptr,  # [M, K], unit column stride
    w_ptr,  # [N, K] contiguous
    bias_ptr,  # [N] (unread without HAS_BIAS)
    out_ptr,  # [M, N] x's dtype, or with SPLIT the float32 workspace [split_k, M, N]
    M,
    N,
    K,
    stride_xm,
    k_per_split,  # a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)[:, None, None]  # [BLOCK_M, 1, 1]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :, None]  # [1, BLOCK_N, 1]
    lanes = tl.arange(0, BLOCK_K)[None, None, :]  # [1, 1, BLOCK_K]
    w_tile = w_ptr + cols.to(tl.int64) * K + lanes  # [1, BLOCK_N, BLOCK_K] at k = 0
    x_tile = x_ptr + rows * stride_xm + lanes  # [BLOCK_M, 1, BLOCK_K]
    col_ok = cols < N
    row_ok = rows < M
    k_start = split * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        k_ok = (k0 + lanes) < K
        # W is streamed once per call: let it leave the cache first; x is re-read by every block.
        w = tl.load(w_tile + k0, mask=col_ok & k_ok, other=0.0, eviction_policy="evict_first")
        x = tl.load(x_tile + k0, mask=row_ok & k_ok, other=0.0, eviction_policy="evict_last")
        acc += x.to(tl.float32) * w.to(tl.float32)  # [BLOCK_M, BLOCK_N, BLOCK_K]
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    out_rows = tl.arange(0, BLOCK_M)[:, None]
    out_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    mask = (out_rows < M) & (out_cols < N)
    if SPLIT:
        tl.store(out_ptr + (split * M + out_rows) * N + out_cols, y, mask=mask)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + out_cols, mask=out_cols < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + out_rows * N + out_cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_k_reduce_kernel(
    partial_ptr,  # [SPLIT_K, M, N] float32
    bias_ptr,  # [N]
    out_ptr,  # [M, N]
    M,
    N,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    y = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # a fixed order: the same sums on every call
        y += tl.load(partial_ptr + (s * M + row) * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {list(x.shape)} and {list(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x is [M, K={x.shape[1]}] but weight is [N, K={weight.shape[1]}]")
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"x and weight must share a dtype of {[str(d) for d in SUPPORTED_DTYPES]}, got "
            f"{x.dtype} and {weight.dtype}"
        )
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous (row-major [N, K]), got strides {weight.stride()}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(
            f"bias must be a contiguous [{weight.shape[0]}] {x.dtype} tensor, got "
            f"{list(bias.shape)} {bias.dtype}"
        )
    if x.device != weight.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"x, weight and bias must be on one device, got {x.device} and {weight.device}")
    if not 1 <= x.shape[0] <= MAX_M or x.shape[1] < 1:
        raise ValueError(f"small-M GEMM takes 1 to {MAX_M} rows and K >= 1, got x {list(x.shape)}")


def small_m_linear(
    x: torch.Tensor,  # [M, K], M <= 16; any row stride
    weight: torch.Tensor,  # [N, K], x's dtype, contiguous
    bias: torch.Tensor | None = None,  # [N], x's dtype
    config: SmallMConfig | None = None,  # None: pick_config's choice
) -> torch.Tensor:  # [M, N] contiguous, x's dtype
    """F.linear(x, weight, bias) for few rows, reading weight exactly once."""
    _check_inputs(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    if config is None:
        config = pick_config(m, n, k, _num_sms(x.device))
    if config.block_m < m:
        raise ValueError(f"config {config} has block_m {config.block_m} < M={m}")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    split = config.split_k > 1
    k_per_split = triton.cdiv(triton.cdiv(k, config.block_k), config.split_k) * config.block_k
    partial = (
        torch.empty((config.split_k, m, n), dtype=torch.float32, device=x.device) if split else out
    )
    bias_arg = bias if bias is not None else out  # never read without HAS_BIAS
    _small_m_gemm_kernel[(triton.cdiv(n, config.block_n), config.split_k)](
        x, weight, bias_arg, partial, m, n, k, x.stride(0), k_per_split,
        HAS_BIAS=bias is not None,
        SPLIT=split,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
    )
    if split:
        _split_k_reduce_kernel[(triton.cdiv(n, _REDUCE_BLOCK), m)](
            partial, bias_arg, out, m, n,
            SPLIT_K=config.split_k,
            HAS_BIAS=bias is not None,
            BLOCK=_REDUCE_BLOCK,
            num_warps=2,
        )
    return out
