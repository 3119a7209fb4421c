"""Activations on fused projections.

On CUDA (when kernel_dispatch.use_triton allows) SiluAndMul is one Triton kernel with the same
roundings; the torch code here is its twin and what the CPU runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from foretell.layers import kernel_dispatch


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2 * intermediate] -> [..., intermediate]
    """silu(gate) * up on a fused gate_up output."""
    if kernel_dispatch.use_triton(gate_up):
        from foretell.layers import fused_kernels  # imports triton: CUDA only

        return fused_kernels.silu_and_mul_triton(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """silu_and_mul as a module (no weights), for the MLPs' `act_fn`."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)
