"""RMSNorm, with an optional fused residual add.

Computed like Hugging Face's: normalise in float32, cast back to the input dtype, then scale by
the weight in that dtype. The residual variant adds in the input dtype first (HF's
`residual + hidden`), so stacking layers with it gives bit-identical residual streams.
"""

from __future__ import annotations

import torch
from torch import nn

from foretell.layers.linear import make_param


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = make_param((hidden_size,), dtype, device)
        self.weight.dummy_value = 1.0  # dummy weights leave norms at identity
        with torch.no_grad():
            self.weight.fill_(1.0)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> same
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def forward(
        self,
        x: torch.Tensor,  # [..., hidden_size]
        residual: torch.Tensor | None = None,  # [..., hidden_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new_residual): new_residual is x + residual (or x), normed its norm."""
        if residual is not None:
            x = residual + x
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
