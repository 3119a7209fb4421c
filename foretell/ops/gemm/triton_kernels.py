"""The few-row kernels a SmallMGemm (ops/gemm/dispatch.py) chooses among, behind one entry point:

  - the FMA GEMV (ops/gemm/triton_gemv.py, SmallMConfig): up to 4 rows, any float dtype;
  - the tensor-core MMA (ops/gemm/triton_mma.py, MmaConfig): up to 16 rows in fp16 / bf16.

A config's type says which kernel runs it. `default_config` is mode "on"'s choice, from the Llama-8B
decode and verify graphs on the H200 (docs/perf-log.md: each layer kind moved to another
kernel, the graph re-timed):
  - one row (decode at batch 1): the GEMV, faster than the MMA or cuBLAS for every layer kind,
    the down projection (K = 14336, four rows of W per program over 2048-wide tiles) included;
  - 2 to 16 rows (a verify of k + 1 tokens, small batches) in fp16 / bf16: the MMA; the GEMV's
    per-row FMA passes lose to cuBLAS there. The down projection (K = 14336, split-K 4) too: with
    its activation moved into gate_up's epilogue it reads a plain input, and the 4-token verify
    graph ran faster than with cuBLAS (slower while it applied the activation).

This module imports triton: CUDA (or the interpreter tests) only.
"""

from __future__ import annotations

import torch

from foretell.ops.gemm import triton_gemv, triton_mma
from foretell.ops.gemm.triton_mma import MmaConfig

MAX_M = max(triton_gemv.MAX_M, triton_mma.MAX_M)


def default_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device):
    """Mode "on"'s kernel config for an [m, k] x [n, k]^T product in dtype, or None for cuBLAS."""
    if m == 1:
        return triton_gemv.pick_config(m, n, k)
    if m > MAX_M or dtype not in triton_mma.SUPPORTED_DTYPES:
        return None
    return triton_mma.pick_config(m, n, k, device)


def candidate_configs(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> list:
    """Every config that can run an [m, k] x [n, k]^T product in dtype (what mode "auto" times
    against cuBLAS): the GEMV's up to 4 rows, the MMA's in fp16 / bf16."""
    gemv = triton_gemv.candidate_configs(m, n, k, device) if m <= triton_gemv.MAX_M else []
    mma = triton_mma.candidate_configs(m, n, k, device) if dtype in triton_mma.SUPPORTED_DTYPES else []
    return gemv + mma


def small_m_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
    config,  # a SmallMConfig or an MmaConfig
    gated: bool = False,  # weight [gate; up]: silu(gate) * up of the product, [M, N // 2]
    float32_out: bool = False,  # the values rounded to x's dtype, stored as float32
) -> torch.Tensor:  # [M, N], x's dtype (or float32)
    kernel = triton_mma.small_m_mma_linear if isinstance(config, MmaConfig) else triton_gemv.small_m_linear
    return kernel(x, weight, bias, config, gated=gated, float32_out=float32_out)
