"""The few-row kernels a SmallMGemm (layers/small_m_dispatch.py) chooses among, behind one entry point:

  - the FMA GEMV (layers/small_m_gemm.py, SmallMConfig): up to 4 rows, any float dtype;
  - the tensor-core MMA (layers/small_m_mma.py, MmaConfig): up to 16 rows in fp16 / bf16.

A config's type says which kernel runs it. `default_config` is mode "on"'s choice, from the Llama-8B
decode and verify graphs on the H200 (scripts/ablate_decode.py: each layer kind moved to another
kernel, the graph re-timed):
  - one row (decode at batch 1): the GEMV. For qkv, o, gate_up and lm_head 0.05-0.2 ms a step
    faster than the MMA or cuBLAS per layer kind; for the down projection (K = 14336, four rows of
    W per program over 2048-wide tiles) 0.05 ms faster than cuBLAS and 0.06 than the MMA;
  - 2 to 16 rows (a verify of k + 1 tokens, small batches) in fp16 / bf16: the MMA; the GEMV's
    per-row FMA passes lose to cuBLAS there. The down projection (K = 14336, split-K 4) too: with
    its activation moved into gate_up's epilogue it reads a plain input, and the 4-token verify
    graph ran 0.017 ms faster than with cuBLAS (0.13-0.15 ms slower while it applied the activation).

This module imports triton: CUDA (or the interpreter tests) only.
"""

from __future__ import annotations

import torch

from foretell.layers import small_m_gemm, small_m_mma
from foretell.layers.small_m_mma import MmaConfig

MAX_M = max(small_m_gemm.MAX_M, small_m_mma.MAX_M)


def default_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device):
    """Mode "on"'s kernel config for an [m, k] x [n, k]^T product in dtype, or None for cuBLAS."""
    if m == 1:
        return small_m_gemm.pick_config(m, n, k)
    if m > MAX_M or dtype not in small_m_mma.SUPPORTED_DTYPES:
        return None
    return small_m_mma.pick_config(m, n, k, device)


def candidate_configs(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> list:
    """Every config that can run an [m, k] x [n, k]^T product in dtype (what mode "auto" times
    against cuBLAS): the GEMV's up to 4 rows, the MMA's in fp16 / bf16."""
    gemv = small_m_gemm.candidate_configs(m, n, k, device) if m <= small_m_gemm.MAX_M else []
    mma = small_m_mma.candidate_configs(m, n, k, device) if dtype in small_m_mma.SUPPORTED_DTYPES else []
    return gemv + mma


def small_m_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
    config,  # a SmallMConfig or an MmaConfig
    gated: bool = False,  # weight [gate; up]: silu(gate) * up of the product, [M, N // 2]
    float32_out: bool = False,  # the values rounded to x's dtype, stored as float32
) -> torch.Tensor:  # [M, N], x's dtype (or float32)
    kernel = small_m_mma.small_m_mma_linear if isinstance(config, MmaConfig) else small_m_gemm.small_m_linear
    return kernel(x, weight, bias, config, gated=gated, float32_out=float32_out)
