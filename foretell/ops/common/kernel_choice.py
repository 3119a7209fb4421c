"""When an op may run its Triton kernel instead of its torch twin: every dispatch.py asks here.

Kept apart from the kernels so that asking never imports triton: a CPU process (and the Triton
interpreter tests, which need triton imported with TRITON_INTERPRET set) never loads it.
"""

from __future__ import annotations

import functools

import torch


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the fused kernels can stand in for the torch path on these tensors: all on CUDA,
    triton installed, and no autograd graph to build (the kernels have no backward)."""
    if not all(t.is_cuda for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return _triton_importable()


@functools.cache
def _triton_importable() -> bool:
    # Reached only with CUDA tensors in hand, where importing triton is what we want anyway.
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
