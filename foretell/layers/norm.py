"""RMSNorm, with an optional fused residual add.

Computed like Hugging Face's: normalise in float32, cast back to the input dtype, then scale by
the weight in that dtype. The residual variant adds in the input dtype first (HF's
`residual + hidden`), so stacking layers with it gives bit-identical residual streams.

On CUDA (when ops/common/kernel_choice.use_triton allows) one Triton kernel does the add and the norm with
the same roundings; the torch code here is its twin and what the CPU runs.
"""

from __future__ import annotations

import torch
from torch import nn

from foretell.ops.common import kernel_choice
from foretell.layers.weight_loaders import make_param


def rms_norm_torch(
    x: torch.Tensor,  # [..., width]
    weight: torch.Tensor,  # [width], or any shape that broadcasts against x (per-head weights)
    eps: float,
) -> torch.Tensor:  # [..., width]
    """HF's RMSNorm: normalise in float32, cast back to x's dtype, then scale by the weight."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # torch.rms_norm does these very operations in float32 (bit for bit; tests/layers/test_layers.py
        # holds them together) from one Python call: fewer dispatches where launches dominate (CPU).
        if weight.dim() == 1:
            return torch.rms_norm(x, (x.shape[-1],), weight, eps)
        return weight * torch.rms_norm(x, (x.shape[-1],), None, eps)
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


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
        return rms_norm_torch(x, self.weight, self.eps)

    def forward(
        self,
        x: torch.Tensor,  # [..., hidden_size]
        residual: torch.Tensor | None = None,  # [..., hidden_size]
        residual_out: torch.Tensor | None = None,  # [tokens, hidden_size], any row stride: where new_residual goes
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new_residual): new_residual is x + residual (or x), normed its norm;
        with residual_out (and a residual) new_residual is written there and returned.

        x may be a per-head view [tokens, heads, head_dim] (Qwen3's q_norm/k_norm)."""
        if self._fused(x, residual):
            from foretell.ops.pointwise import triton_kernels  # imports triton: CUDA only

            return triton_kernels.rms_norm_triton(x, self.weight, self.eps, residual, residual_out=residual_out)
        if residual is not None:
            x = residual + x
            if residual_out is not None:
                x = residual_out.copy_(x)
        return self._norm(x), x

    def _fused(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        # Mixed dtypes promote in the torch path; the kernel keeps x's dtype, so leave them to it.
        tensors = (x, self.weight) if residual is None else (x, self.weight, residual)
        same_dtype = all(t.dtype == x.dtype for t in tensors)
        return same_dtype and x.shape[-1] == self.hidden_size and kernel_choice.use_triton(*tensors)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
