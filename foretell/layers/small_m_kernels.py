"""The few-row kernels a SmallMGemm (layers/small_m_dispatch.py) chooses among, behind one entry point:

  - the FMA GEMV (layers/small_m_gemm.py, SmallMConfig): up to 4 rows, any float dtype; the
    default for a single row (decode at batch 1) where a program reads its rows of W in one tile
    (K <= 4096), where it reads weights fastest;
  - the tensor-core MMA (layers/small_m_mma.py, MmaConfig): up to 16 rows in fp16 / bf16; the
    default from two rows on (a verify of k + 1 tokens, small batches), where the GEMV's per-row
    FMA passes lose to cuBLAS, and for one row of a long K (Llama's down projection, K = 14336:
    its pipelined tiles beat the GEMV's serial ones, 0.11 ms a step in the Llama-8B decode graph).

A config's type says which kernel runs it. This module imports triton: CUDA (or the interpreter
tests) only.
"""

from __future__ import annotations

import torch

from foretell.layers import small_m_gemm, small_m_mma
from foretell.layers.small_m_mma import MmaConfig

MAX_M = max(small_m_gemm.MAX_M, small_m_mma.MAX_M)


def candidate_configs(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> list:
    """Every config that can run an [m, k] x [n, k]^T product in dtype, the default first (what mode
    "on" takes; empty: leave it to cuBLAS)."""
    gemv = small_m_gemm.candidate_configs(m, n, k, device) if m <= small_m_gemm.MAX_M else []
    mma = small_m_mma.candidate_configs(m, n, k, device) if dtype in small_m_mma.SUPPORTED_DTYPES else []
    if m == 1:
        long_k = k > small_m_gemm.MAX_BLOCK_K
        return mma + gemv if long_k and mma else gemv + mma
    return mma  # the GEMV's per-row passes lose to cuBLAS from 2 rows on (BENCHMARKS.md)


def small_m_linear(
    x: torch.Tensor,  # [M, K] (or [M, 2K] with silu_mul)
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
    config,  # a SmallMConfig or an MmaConfig
    silu_mul: bool = False,
) -> torch.Tensor:  # [M, N], x's dtype
    if isinstance(config, MmaConfig):
        return small_m_mma.small_m_mma_linear(x, weight, bias, config, silu_mul=silu_mul)
    return small_m_gemm.small_m_linear(x, weight, bias, config, silu_mul=silu_mul)
