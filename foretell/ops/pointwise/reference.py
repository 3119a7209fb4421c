"""Plain-torch twins of the per-row ops of a decoder layer (triton_kernels.py): RoPE in either
pairing and SiLU-and-mul. What the CPU runs, and what the kernels are held to.

The RMSNorm twin is the torch path of layers/norm.py's RMSNorm (it owns its weight and eps), and the
rotary module (layers/rotary.py) builds its cos/sin tables and applies the functions here.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

ApplyFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def apply_rope_neox(
    x: torch.Tensor,  # [num_tokens, num_heads, rotary_dim]
    cos: torch.Tensor,  # [num_tokens, rotary_dim // 2] float32
    sin: torch.Tensor,  # [num_tokens, rotary_dim // 2] float32
) -> torch.Tensor:  # [num_tokens, num_heads, rotary_dim]
    # Same arithmetic, in x's dtype, as HF's x * cos + rotate_half(x) * sin, so bf16 runs agree.
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rope_gptj(
    x: torch.Tensor,  # [num_tokens, num_heads, rotary_dim], pairs (x0, x1), (x2, x3), ...
    cos: torch.Tensor,  # [num_tokens, rotary_dim // 2] float32
    sin: torch.Tensor,  # [num_tokens, rotary_dim // 2] float32
) -> torch.Tensor:  # [num_tokens, num_heads, rotary_dim], pairs kept interleaved
    # DeepSeek's view_as_complex(x) * e^(i*theta). The output stays interleaved; transformers'
    # DeepSeek-V3 de-interleaves it instead, which permutes q and k alike and so leaves every
    # q.k product, and the attention, unchanged.
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


APPLY_STYLES: dict[str, ApplyFn] = {
    "neox": apply_rope_neox,
    "gptj": apply_rope_gptj,
}


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2 * intermediate] -> [..., intermediate]
    """silu(gate) * up on a fused gate_up output."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
