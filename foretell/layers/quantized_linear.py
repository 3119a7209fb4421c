"""FP8 weights in the model (issue 25): `quantize_model_fp8_`, what `quantization="fp8"` does to a
loaded float model, and `Fp8Linear`, a standalone FP8 linear for callers outside the models.

The models' own layers hold FP8 themselves: Linear and its fused / tensor-parallel subclasses
(layers/linear.py, `fp8_block`) and the packed experts (layers/packed_experts.py) take an FP8
block-quantized checkpoint's `weight` + `weight_scale_inv` as they ship, and compute through
ops/gemm/fp8_dispatch.fp8_linear and ops/moe/fp8_dispatch.fused_fp8_experts. `quantize_model_fp8_`
turns a float model's linears and experts into that same layout after loading, so a bf16 Llama or
Qwen3 runs the same kernels, reading half the bytes.

Fp8Linear (unfused, one rank) keeps per-output-channel scales as an option (`block_size` None):
  - from a block-quantized checkpoint: parameters `weight` and `weight_scale_inv` under the
    checkpoint's own names, each with a weight_loader that copies them bit for bit;
  - from a float weight: Fp8Linear.quantized, one scale per output channel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from foretell.layers.linear import Linear
from foretell.layers.weight_loaders import check_shape, default_weight_loader
from foretell.layers.packed_experts import PackedExperts
from foretell.ops.gemm.fp8_dispatch import fp8_linear
from foretell.ops.gemm.fp8_reference import FP8_DTYPE, blocks, check_fp8_weight, quantize_fp8_per_channel


def _exact_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a checkpoint tensor that must already have the parameter's dtype (FP8 bits and their
    scales are not converted by value: a float weight here would be a wrong checkpoint)."""
    if shard_id is not None:
        raise ValueError(f"parameter is not fused but was given shard {shard_id!r}")
    check_shape(loaded, param.shape, "parameter")
    if loaded.dtype != param.dtype:
        raise ValueError(f"expected a {param.dtype} tensor (an FP8 checkpoint's weight or weight_scale_inv), "
                         f"found {loaded.dtype}")
    with torch.no_grad():
        param.copy_(loaded)


class Fp8Linear(nn.Module):
    """y = x (weight * scale)^T (+ bias), the weight read in 8 bits."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        block_size: tuple[int, int] | None = (128, 128),  # None: per-channel scales [N, 1]
        dtype: torch.dtype | None = None,  # the bias's (and the output's, from x)
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.input_size, self.output_size, self.block_size = input_size, output_size, block_size
        scale_shape = ((output_size, 1) if block_size is None else
                       (blocks(output_size, block_size[0]), blocks(input_size, block_size[1])))
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32, device=device),
                                             requires_grad=False)
        self.weight.weight_loader = self.weight_scale_inv.weight_loader = _exact_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype, device=device), requires_grad=False)
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)

    @classmethod
    def quantized(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Fp8Linear":
        """`quantization="fp8"`: a float weight [N, K] quantized per output channel."""
        q, scale = quantize_fp8_per_channel(weight)
        layer = cls(weight.shape[1], weight.shape[0], bias is not None, None, weight.dtype, weight.device)
        with torch.no_grad():
            layer.weight.copy_(q)
            layer.weight_scale_inv.copy_(scale)
            if bias is not None:
                layer.bias.copy_(bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N], x's dtype
        bias = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.block_size, bias)

    def check(self) -> None:
        """ValueError naming the mismatch if the loaded weight and scales do not fit each other."""
        check_fp8_weight(self.weight, self.weight_scale_inv, self.block_size)

    def extra_repr(self) -> str:
        scales = "per channel" if self.block_size is None else f"{self.block_size[0]}x{self.block_size[1]} blocks"
        return f"in={self.input_size}, out={self.output_size}, fp8 e4m3, scales {scales}, bias={self.bias is not None}"


@torch.no_grad()
def quantize_model_fp8_(model: nn.Module, block: tuple[int, int] = (128, 128)) -> int:
    """Every float Linear (but those marked not quantizable) and every float PackedExperts of a
    loaded model into FP8 blocks of `block`, in place, one layer at a time (the float weight of
    each is freed before the next is quantized). Returns how many layers were quantized."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.quantizable and not module.is_fp8:
            module.quantize_fp8_(block)
            count += 1
        elif isinstance(module, PackedExperts) and module.format == "float":
            module.quantize_fp8_(block)
            count += 1
    return count

