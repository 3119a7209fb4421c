"""Plain-torch twins of the FP8 linear kernels (triton_fp8_few_rows.py, triton_fp8_gemm.py): what the
CPU runs and what the kernels are held to.

Two weight layouts, one call signature (`weight` float8_e4m3fn [N, K], `weight_scale` float32):
  - block-quantized, as DeepSeek-V3/R1 and Kimi-K2 ship them: `weight_scale` is the checkpoint's
    `weight_scale_inv` [ceil(N / bn), ceil(K / bk)] for `block_size` (bn, bk) (config.json's
    quantization_config.weight_block_size, 128 x 128 in every published checkpoint); the real
    weight is each block times its scale (despite the name, the scale multiplies: W = q * s);
  - per output channel (`block_size` None), what `quantization="fp8"` makes of a bf16 checkpoint at
    load: `weight_scale` [N, 1], W[n] = q[n] * s[n] (quantize_fp8_per_channel).

Two products:
  - fp8_linear_torch: y = x (q * s)^T in float32 from x as it is (the few-row kernels: decode,
    verify, draft; also what the CPU runs for every M);
  - fp8_linear_quantized_activations_torch: the large-M kernel's math: x first quantized to FP8 per
    token and group of 128 columns (scale = the group's amax / 448, as the checkpoints were
    trained), then y = xq sx (q s)^T in float32.
Both round the float32 result (+ bias) to x's dtype once.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value: a group's or row's amax maps onto it
ACTIVATION_GROUP = 128  # columns of x sharing one scale (the checkpoints' block width)
# A scale never drops below this amax / 448: an all-zero group (padding, a zero row) quantizes to
# zeros instead of 0 / 0.
MIN_AMAX = 1e-10


def blocks(n: int, block: int) -> int:
    return -(-n // block)


def amax_to_scale(amax: torch.Tensor) -> torch.Tensor:
    """max(amax, MIN_AMAX) / 448 in float32, correctly rounded on every device. (On CUDA, torch
    divides by a Python scalar as a multiply by its reciprocal, which can be one ulp off the
    quotient: the activation quantizer's kernel divides with div_rn, and its twin must give the
    same bits; a 0-d tensor on the same device is a true division.)"""
    divisor = torch.tensor(FP8_MAX, dtype=torch.float32, device=amax.device)
    return amax.float().clamp(min=MIN_AMAX) / divisor


def check_fp8_weight(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] or [N, 1] float32
    block_size: tuple[int, int] | None,  # None: one scale per output channel
) -> None:
    """Raise a ValueError naming what is wrong unless weight and weight_scale fit each other."""
    if weight.dim() != 2 or weight.dtype != FP8_DTYPE:
        raise ValueError(f"an FP8 weight must be a 2-D float8_e4m3fn [N, K] tensor, got {weight.dtype} "
                         f"{list(weight.shape)}")
    n, k = weight.shape
    if block_size is None:
        expected = (n, 1)
    else:
        if len(block_size) != 2 or any(int(b) != b or b < 1 for b in block_size):
            raise ValueError(f"block_size must be two positive integers (rows, columns), got {block_size!r}")
        expected = (blocks(n, block_size[0]), blocks(k, block_size[1]))
    if tuple(weight_scale.shape) != expected or weight_scale.dtype != torch.float32:
        what = "per-channel" if block_size is None else f"{block_size[0]}x{block_size[1]}-block"
        raise ValueError(f"the {what} scale of an FP8 weight {list(weight.shape)} must be float32 "
                         f"{list(expected)}, got {weight_scale.dtype} {list(weight_scale.shape)}")


def dequantize_fp8(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] or [N, 1] float32
    block_size: tuple[int, int] | None,
) -> torch.Tensor:  # [N, K] float32: each element times its block's (or row's) scale
    n, k = weight.shape
    if block_size is None:
        return weight.float() * weight_scale.float()
    scales = weight_scale.float().repeat_interleave(block_size[0], dim=0)[:n]
    scales = scales.repeat_interleave(block_size[1], dim=1)[:, :k]
    return weight.float() * scales


def fp8_linear_torch(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # float32, see check_fp8_weight
    block_size: tuple[int, int] | None,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N], x's dtype
    """x (q * s)^T (+ bias), dequantized on the fly and summed in float32, rounded to x's dtype."""
    w = dequantize_fp8(weight, weight_scale, block_size)  # [N, K] float32
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_fp8_per_token_group(
    x: torch.Tensor,  # [M, K] float
    group: int = ACTIVATION_GROUP,
) -> tuple[torch.Tensor, torch.Tensor]:  # q [M, K] float8_e4m3fn, scales [M, ceil(K / group)] float32
    """Each row's groups of `group` columns (the last one ragged) scaled so the group's amax is 448:
    scale = max(amax, MIN_AMAX) / 448, q = round(x / scale) to e4m3 (nearest even), x ~ q * scale.
    Divisions in float32, correctly rounded (the kernel divides with div_rn)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {list(x.shape)}")
    m, k = x.shape
    groups = blocks(k, group)
    padded = torch.zeros(m, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    tiles = padded.view(m, groups, group)  # [M, G, group]
    scales = amax_to_scale(tiles.abs().amax(dim=-1))  # [M, G]
    q = (tiles / scales[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * group)[:, :k].contiguous(), scales


def dequantize_per_token_group(
    q: torch.Tensor,  # [M, K] float8_e4m3fn
    scales: torch.Tensor,  # [M, ceil(K / group)] float32
    group: int = ACTIVATION_GROUP,
) -> torch.Tensor:  # [M, K] float32
    k = q.shape[1]
    return q.float() * scales.repeat_interleave(group, dim=1)[:, :k]


def fp8_linear_quantized_activations_torch(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # float32, see check_fp8_weight
    block_size: tuple[int, int] | None,
    bias: torch.Tensor | None = None,  # [N]
    group: int = ACTIVATION_GROUP,
) -> torch.Tensor:  # [M, N], x's dtype
    """The large-M kernel's product: x quantized per token group, both operands' scales applied
    per block of K, summed in float32, rounded to x's dtype."""
    q, scales = quantize_fp8_per_token_group(x, group)
    xq = dequantize_per_token_group(q, scales, group)  # [M, K] float32
    y = xq @ dequantize_fp8(weight, weight_scale, block_size).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_fp8_per_channel(
    weight: torch.Tensor,  # [N, K] float (a bf16 checkpoint's weight)
) -> tuple[torch.Tensor, torch.Tensor]:  # q [N, K] float8_e4m3fn, scale [N, 1] float32
    """One scale per output channel (row): scale = max(amax, MIN_AMAX) / 448, q = round(W / scale),
    so W ~ q * scale with e4m3's 3 mantissa bits (a relative error of at most 2^-4 per element)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"a weight to quantize must be a float [N, K] tensor, got {weight.dtype} "
                         f"{list(weight.shape)}")
    w = weight.float()
    scale = amax_to_scale(w.abs().amax(dim=1, keepdim=True))  # [N, 1]
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_fp8_blocks(
    weight: torch.Tensor,  # [N, K] float
    block_size: tuple[int, int] = (128, 128),
) -> tuple[torch.Tensor, torch.Tensor]:  # q [N, K] float8_e4m3fn, scale [ceil(N/bn), ceil(K/bk)] float32
    """The checkpoints' layout made from a float weight (each block's amax mapped to 448): for
    tests, and for `quantization="fp8"` by blocks."""
    n, k = weight.shape
    bn, bk = block_size
    rows, cols = blocks(n, bn), blocks(k, bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.float()
    tiles = padded.view(rows, bn, cols, bk)
    scale = amax_to_scale(tiles.abs().amax(dim=(1, 3)))  # [rows, cols]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows * bn, cols * bk)[:n, :k].contiguous(), scale
