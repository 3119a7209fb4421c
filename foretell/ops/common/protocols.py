"""What an op reads off a layer's module when a layer hands it one (an RMSNorm, a RotaryEmbedding).

The kernels and their twins take the module itself (one argument instead of four tensors and two
numbers), but ops import nothing of layers/: these protocols name the attributes they use, and
layers/norm.py's RMSNorm and layers/rotary.py's RotaryEmbedding satisfy them as they are.
"""

from __future__ import annotations

from typing import Protocol

import torch


class NormModule(Protocol):
    """An RMSNorm: y = weight * normalise(x) over the last dimension (layers/norm.py)."""

    hidden_size: int
    eps: float
    weight: torch.Tensor  # [hidden_size]

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # (normed, new_residual)


class RotaryModule(Protocol):
    """A rotary embedding with its cos/sin tables built up front (layers/rotary.py)."""

    rotary_dim: int
    style: str  # "neox" (rotate halves) | "gptj" (rotate interleaved pairs)
    cos_cache: torch.Tensor  # [max_positions, rotary_dim // 2] float32
    sin_cache: torch.Tensor  # [max_positions, rotary_dim // 2] float32

    def cos_sin(
        self, positions: torch.Tensor  # [num_tokens]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # [num_tokens, rotary_dim // 2] float32 each

    def __call__(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # (rotated query, rotated key)
