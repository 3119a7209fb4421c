"""Plain-torch twin of the FP8 experts (DeepSeek-V3/R1 and Kimi-K2 routed and shared experts as
they ship: float8_e4m3fn weights with float32 scales per (b0, b1) block): what the CPU runs and what
fp8_triton_gemv.py is held to.

Layout, stacked per layer as the float experts are (ops/moe/reference.py):
  gate_up        [E, 2 * I, H] float8_e4m3fn (gate rows, then up rows)
  gate_up_scale  [E, ceil(2 * I / b0), ceil(H / b1)] float32: row r, column k of expert e is
                 gate_up[e, r, k] * gate_up_scale[e, r // b0, k // b1]
  down           [E, H, I] float8_e4m3fn, down_scale [E, ceil(H / b0), ceil(I / b1)] likewise.
The real weight is q * scale rounded once to the model dtype (hidden's): the weights a checkpoint
dequantized to that dtype would hold, so the FP8 experts compute what the dequantized model's
experts compute (same sums and roundings, experts_forward_torch), reading half the bytes.
"""

from __future__ import annotations

import torch

from foretell.ops.gemm.fp8_reference import FP8_DTYPE, blocks
from foretell.ops.moe.reference import check_routing, experts_forward_torch


def check_fp8_experts(
    hidden: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2 * I, H] float8_e4m3fn
    gate_up_scale: torch.Tensor,  # [E, ceil(2I / b0), ceil(H / b1)] float32
    down: torch.Tensor,  # [E, H, I] float8_e4m3fn
    down_scale: torch.Tensor,  # [E, ceil(H / b0), ceil(I / b1)] float32
    block: tuple[int, int],
    weights: torch.Tensor,  # [T, top_k]
    ids: torch.Tensor,  # [T, top_k]
    shared: torch.Tensor | None,  # [T, H]
) -> tuple[int, int, int, int]:
    """(num_tokens, top_k, hidden_size, inter) of consistent inputs; ValueError naming the mismatch."""
    if len(block) != 2 or any(int(b) != b or b < 1 for b in block):
        raise ValueError(f"block must be two positive integers (rows, columns), got {block!r}")
    if hidden.dim() != 2 or gate_up.dim() != 3 or gate_up.shape[1] % 2:
        raise ValueError(f"expected hidden [T, H] and gate_up [E, 2 * I, H], got {list(hidden.shape)} and "
                         f"{list(gate_up.shape)}")
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    b0, b1 = block
    expected = {
        "gate_up": (gate_up, FP8_DTYPE, (num_experts, two_inter, hidden_size)),
        "down": (down, FP8_DTYPE, (num_experts, hidden_size, inter)),
        "gate_up_scale": (gate_up_scale, torch.float32, (num_experts, blocks(two_inter, b0), blocks(hidden_size, b1))),
        "down_scale": (down_scale, torch.float32, (num_experts, blocks(hidden_size, b0), blocks(inter, b1))),
    }
    for name, (tensor, dtype, shape) in expected.items():
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"FP8 experts: {name} must be {dtype} {list(shape)} for hidden {hidden_size}, "
                             f"{num_experts} experts of {inter} in {b0}x{b1} blocks; got {tensor.dtype} "
                             f"{list(tensor.shape)}")
    return num_tokens, check_routing(ids, weights, shared, num_tokens, hidden_size), hidden_size, inter


def dequantize_fp8_experts(
    q: torch.Tensor,  # [U, N, K] float8_e4m3fn
    scale: torch.Tensor,  # [U, ceil(N / b0), ceil(K / b1)] float32
    block: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:  # [U, N, K] dtype: q * scale per block, rounded once to dtype
    n, k = q.shape[1:]
    scales = scale.repeat_interleave(block[0], dim=1)[:, :n].repeat_interleave(block[1], dim=2)[:, :, :k]
    return (q.float() * scales).to(dtype)


def fp8_experts_forward_torch(
    hidden: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2 * I, H] float8_e4m3fn
    gate_up_scale: torch.Tensor,  # [E, ceil(2I / b0), ceil(H / b1)] float32
    down: torch.Tensor,  # [E, H, I] float8_e4m3fn
    down_scale: torch.Tensor,  # [E, ceil(H / b0), ceil(I / b1)] float32
    block: tuple[int, int],
    weights: torch.Tensor,  # [T, top_k] float32
    ids: torch.Tensor,  # [T, top_k] int64
) -> torch.Tensor:  # [T, H] float32 (summed over the top_k experts)
    """The used experts dequantized to hidden's dtype, then experts_forward_torch."""
    check_fp8_experts(hidden, gate_up, gate_up_scale, down, down_scale, block, weights, ids, None)
    used, compact_ids = torch.unique(ids, return_inverse=True)  # experts the tokens go to (one host sync)
    w_gate_up = dequantize_fp8_experts(gate_up[used], gate_up_scale[used], block, hidden.dtype)  # [U, 2I, H]
    w_down = dequantize_fp8_experts(down[used], down_scale[used], block, hidden.dtype)  # [U, H, I]
    return experts_forward_torch(hidden, w_gate_up, w_down, weights, compact_ids)
