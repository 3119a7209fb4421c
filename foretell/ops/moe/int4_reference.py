"""Plain-torch twins of the int4 experts (Kimi-K2.5's routed experts as they ship, the
compressed-tensors "pack-quantized" format): unpacking, packing, group quantization and the
experts' forward over packed weights. What the CPU runs and what triton_int4_gemv.py is held to.

The format (compressed-tensors, num_bits 4, type int, symmetric, strategy group, group_size 32),
per linear of an expert, for a weight [N, K]:
  weight_packed  int32 [N, ceil(K / 8)]: column k is nibble k % 8 (bits 4 (k % 8) ..) of word
                 k // 8, little end first, stored offset by 8 (nibble = q + 8, q in [-8, 7]);
  weight_scale   [N, ceil(K / 32)] in the model's dtype (bf16): one per row and group of 32;
  weight_shape   int [2] = (N, K).
The real weight is q * scale, computed in the scale's dtype (as compressed-tensors dequantizes:
the bf16 weights a dequantized checkpoint would hold). Checked against the compressed-tensors
package itself in tests/ops/test_moe_int4.py.

Stacked per layer the way the bf16 experts are (ops/moe/reference.py): gate_up [E, 2I, H] becomes
packed [E, 2I, ceil(H / 8)] with scales [E, 2I, ceil(H / 32)] (gate rows, then up rows), down
[E, H, I] packed [E, H, ceil(I / 8)] with scales [E, H, ceil(I / 32)].
"""

from __future__ import annotations

import torch

from foretell.ops.moe.reference import check_routing, experts_forward_torch

INT4_GROUP = 32  # columns per scale
PACK = 8  # int4 values per int32 word
INT4_MIN, INT4_MAX = -8, 7


def words(k: int) -> int:
    return -(-k // PACK)


def groups(k: int, group: int = INT4_GROUP) -> int:
    return -(-k // group)


def check_int4_weight(
    packed: torch.Tensor,  # [..., N, ceil(K / 8)] int32
    scale: torch.Tensor,  # [..., N, ceil(K / 32)] float
    k: int,
    name: str = "int4 weight",
) -> None:
    """Raise a ValueError naming what is wrong unless packed and scale hold a [..., N, K] weight."""
    if packed.dtype != torch.int32 or packed.dim() < 2:
        raise ValueError(f"{name}: weight_packed must be int32 [..., N, ceil(K / 8)], got {packed.dtype} "
                         f"{list(packed.shape)}")
    if packed.shape[-1] != words(k):
        raise ValueError(f"{name}: weight_packed {list(packed.shape)} does not hold K={k} columns "
                         f"(expected {words(k)} int32 words per row)")
    expected = (*packed.shape[:-1], groups(k))
    if tuple(scale.shape) != expected or not scale.is_floating_point():
        raise ValueError(f"{name}: weight_scale must be a float {list(expected)} tensor (one per row and group "
                         f"of {INT4_GROUP}), got {scale.dtype} {list(scale.shape)}")


def check_int4_expert_inputs(hidden, gate_up_packed, gate_up_scale, down_packed, down_scale, weights, ids, shared):
    """(num_tokens, top_k, hidden_size, inter) of consistent inputs; ValueError naming the mismatch."""
    if hidden.dim() != 2 or gate_up_packed.dim() != 3 or gate_up_packed.shape[1] % 2:
        raise ValueError(f"expected hidden [T, H] and gate_up weight_packed [E, 2 * I, ceil(H / 8)], got "
                         f"{list(hidden.shape)} and {list(gate_up_packed.shape)}")
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = gate_up_packed.shape[0], gate_up_packed.shape[1] // 2
    check_int4_weight(gate_up_packed, gate_up_scale, hidden_size, "gate_up")
    if down_packed.dim() != 3 or down_packed.shape[:2] != (num_experts, hidden_size):
        raise ValueError(f"down weight_packed must be [E={num_experts}, H={hidden_size}, ceil(I / 8)], got "
                         f"{list(down_packed.shape)}")
    check_int4_weight(down_packed, down_scale, inter, "down")
    if gate_up_scale.dtype != down_scale.dtype or not gate_up_scale.dtype.is_floating_point:
        raise ValueError(f"gate_up and down scales must share a float dtype, got {gate_up_scale.dtype} and "
                         f"{down_scale.dtype}")
    return num_tokens, check_routing(ids, weights, shared, num_tokens, hidden_size), hidden_size, inter


def unpack_int4(
    packed: torch.Tensor,  # [..., N, ceil(K / 8)] int32
    k: int,
) -> torch.Tensor:  # [..., N, K] int8 in [-8, 7]
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int32, device=packed.device)  # [8]
    nibbles = (packed[..., None] >> shifts) & 0xF  # [..., N, words, 8]
    return (nibbles.flatten(-2)[..., :k] - 8).to(torch.int8)


def pack_int4(
    values: torch.Tensor,  # [..., N, K] integers in [-8, 7]
) -> torch.Tensor:  # [..., N, ceil(K / 8)] int32
    if values.is_floating_point() or values.numel() and not (INT4_MIN <= int(values.min()) and
                                                             int(values.max()) <= INT4_MAX):
        raise ValueError(f"int4 values must be integers in [{INT4_MIN}, {INT4_MAX}], got {values.dtype}")
    k = values.shape[-1]
    padded = torch.zeros(*values.shape[:-1], words(k) * PACK, dtype=torch.int64, device=values.device)
    padded[..., :k] = values.to(torch.int64) + 8  # padding nibbles stay 0, as compressed-tensors pads
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int64, device=values.device)
    unsigned = (padded.unflatten(-1, (-1, PACK)) << shifts).sum(dim=-1)  # [..., N, words] in [0, 2^32)
    return (unsigned - (unsigned >= 2**31).to(torch.int64) * 2**32).to(torch.int32)  # the same 32 bits


def quantize_int4_groups(
    weight: torch.Tensor,  # [..., N, K] float (the dtype the scales are kept in: bf16 for Kimi)
    group: int = INT4_GROUP,
) -> tuple[torch.Tensor, torch.Tensor]:  # q [..., N, K] int8, scale [..., N, ceil(K / group)] weight's dtype
    """Symmetric int4 per row and group, as compressed-tensors computes it: scale = amax / 7.5 in
    the weight's dtype (its eps where a group is all zero), q = clamp(round(w / scale), -8, 7),
    the division in the weight's dtype, rounding half to even."""
    k = weight.shape[-1]
    g = groups(k, group)
    padded = torch.zeros(*weight.shape[:-1], g * group, dtype=weight.dtype, device=weight.device)
    padded[..., :k] = weight
    tiles = padded.unflatten(-1, (g, group))  # [..., N, G, group]
    amax = tiles.abs().amax(dim=-1)  # [..., N, G]
    scale = amax / torch.tensor(7.5, dtype=weight.dtype)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(weight.dtype).eps, dtype=weight.dtype), scale)
    q = torch.round(tiles / scale[..., None]).clamp(INT4_MIN, INT4_MAX)
    return q.flatten(-2)[..., :k].to(torch.int8), scale


def dequantize_int4(
    packed: torch.Tensor,  # [..., N, ceil(K / 8)] int32
    scale: torch.Tensor,  # [..., N, ceil(K / group)]
    k: int,
    group: int = INT4_GROUP,
) -> torch.Tensor:  # [..., N, K] in scale's dtype: q * scale, rounded once to that dtype
    q = unpack_int4(packed, k)
    return q.to(scale.dtype) * scale.repeat_interleave(group, dim=-1)[..., :k]


def int4_experts_forward_torch(
    hidden: torch.Tensor,  # [num_tokens, H]
    gate_up_packed: torch.Tensor,  # [E, 2 * I, ceil(H / 8)] int32
    gate_up_scale: torch.Tensor,  # [E, 2 * I, ceil(H / 32)]
    down_packed: torch.Tensor,  # [E, H, ceil(I / 8)] int32
    down_scale: torch.Tensor,  # [E, H, ceil(I / 32)]
    weights: torch.Tensor,  # [num_tokens, top_k] float32
    ids: torch.Tensor,  # [num_tokens, top_k] int64
) -> torch.Tensor:  # [num_tokens, H] float32 (summed over the top_k experts)
    """The used experts dequantized (to the scales' dtype), then experts_forward_torch: the same
    sums and roundings as the bf16 experts of a dequantized checkpoint."""
    _, _, hidden_size, inter = check_int4_expert_inputs(hidden, gate_up_packed, gate_up_scale, down_packed,
                                                        down_scale, weights, ids, None)
    used, compact_ids = torch.unique(ids, return_inverse=True)  # experts the tokens go to (one host sync)
    gate_up = dequantize_int4(gate_up_packed[used], gate_up_scale[used], hidden_size)  # [U, 2I, H]
    down = dequantize_int4(down_packed[used], down_scale[used], inter)  # [U, H, I]
    return experts_forward_torch(hidden.to(gate_up.dtype), gate_up, down, weights, compact_ids)
