"""The few-row kernels a SmallMGemm (layers/small_m_dispatch.py) chooses among, behind one entry point:

  - the FMA GEMV (layers/small_m_gemm.py, SmallMConfig): up to 4 rows, any float dtype;
  - the tensor-core MMA (layers/small_m_mma.py, MmaConfig): up to 16 rows in fp16 / bf16.

A config's type says which kernel runs it. `default_config` is mode "on"'s choice, from the Llama-8B
decode and verify graphs on the H200 (scripts/ablate_decode.py: each layer kind moved to another
kernel, the graph re-timed):
  - K up to 4096 (one GEMV tile: qkv, o, gate_up, lm_head): the GEMV for one row (decode at batch
    1; 0.05-0.18 ms a step faster than the MMA or cuBLAS per layer kind), the MMA for 2 to 16 rows
    (a verify of k + 1 tokens, small batches: the GEMV's per-row FMA passes lose to cuBLAS there);
  - a longer K (Llama's down projection, 14336): cuBLAS at every M. The GEMV loops over K
    serially (0.16 ms a step slower at one row) and the MMA needs split-K, whose merge by the last
    split delays the next kernel (0.06 ms slower at one row, 0.15 at four).

This module imports triton: CUDA (or the interpreter tests) only.
"""

from __future__ import annotations

import torch

from foretell.layers import small_m_gemm, small_m_mma
from foretell.layers.small_m_mma import MmaConfig

MAX_M = max(small_m_gemm.MAX_M, small_m_mma.MAX_M)


def default_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device):
    """Mode "on"'s kernel config for an [m, k] x [n, k]^T product in dtype, or None for cuBLAS."""
    if k > small_m_gemm.MAX_BLOCK_K or not 1 <= m <= MAX_M:
        return None
    if m == 1:
        return small_m_gemm.pick_config(m, n, k)
    return small_m_mma.pick_config(m, n, k, device) if dtype in small_m_mma.SUPPORTED_DTYPES else None


def candidate_configs(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> list:
    """Every config that can run an [m, k] x [n, k]^T product in dtype (what mode "auto" times
    against cuBLAS): the GEMV's up to 4 rows, the MMA's in fp16 / bf16."""
    gemv = small_m_gemm.candidate_configs(m, n, k, device) if m <= small_m_gemm.MAX_M else []
    mma = small_m_mma.candidate_configs(m, n, k, device) if dtype in small_m_mma.SUPPORTED_DTYPES else []
    return gemv + mma


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
