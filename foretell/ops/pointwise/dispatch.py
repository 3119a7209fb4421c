"""The entry points layers call for the per-row ops: the Triton kernel (triton_kernels.py) on CUDA
when ops.common.kernel_choice.use_triton allows, else the torch twin (reference.py).

RMSNorm and RoPE choose in their modules (layers/norm.py, layers/rotary.py), which own the weight
and the cos/sin tables; they load triton_kernels.py the same lazy way.
"""

from __future__ import annotations

import torch

from foretell.ops.common import kernel_choice
from foretell.ops.pointwise.reference import silu_and_mul_torch


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2 * intermediate] -> [..., intermediate]
    """silu(gate) * up on a fused gate_up output."""
    if kernel_choice.use_triton(gate_up):
        from foretell.ops.pointwise import triton_kernels  # imports triton: CUDA only

        return triton_kernels.silu_and_mul_triton(gate_up)
    return silu_and_mul_torch(gate_up)
