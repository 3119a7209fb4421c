"""SiLU-and-mul of the batch-invariant mode (issue 23), in torch.

On the CPU an elementwise transcendental (exp, sigmoid, silu) is not the same function at every
position of a tensor: ATen runs the vectorised (Sleef) form over whole vectors and the scalar form
(libm) on each thread chunk's tail, and where chunks and tails fall depends on the tensor's size,
so a row's activations can differ by an ulp between M = 1 and M = 64 (the MoE router's float32
sigmoid did, tests/ops/test_batch_invariant_moe.py). Here the sigmoid runs in float64 and is
rounded to the input's dtype: the two forms' float64 results differ by at most an ulp of float64,
which rounding to float32 or bf16 removes (a flip needs the value within 2^-29 of a float32
rounding boundary). The products and roundings after it are exact IEEE operations (position-free).
"""

from __future__ import annotations

import torch


def silu_batch_invariant(x: torch.Tensor) -> torch.Tensor:  # same shape and dtype
    """silu(x) = x * sigmoid(x), computed in float64 and rounded once to x's dtype (F.silu rounds once)."""
    wide = x.double()
    return (wide * torch.sigmoid(wide)).to(x.dtype)


def silu_and_mul_batch_invariant(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2 * I] -> [..., I]
    """silu(gate) * up on a fused gate_up output, with silu_and_mul_torch's roundings."""
    gate, up = gate_up.chunk(2, dim=-1)
    return silu_batch_invariant(gate) * up
