"""Activations on fused projections, as modules.

The op itself (a Triton kernel on CUDA, its torch twin elsewhere) is ops/pointwise's silu_and_mul.
"""

from __future__ import annotations

import torch
from torch import nn

from foretell.ops.pointwise.dispatch import silu_and_mul


class SiluAndMul(nn.Module):
    """silu_and_mul as a module (no weights), for the MLPs' `act_fn`."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)
