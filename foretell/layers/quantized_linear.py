"""A linear layer that keeps its weight in FP8 (issue 25): `weight` float8_e4m3fn [N, K] and its
float32 scales, computed by ops/gemm/fp8_dispatch.fp8_linear (the few-row kernels for decode,
verify and draft, the FP8 tensor-core GEMM for prefill on CUDA; the torch twin on CPU).

Two ways to fill one:
  - from a block-quantized checkpoint (DeepSeek-V3/R1, Kimi-K2): parameters `weight` and
    `weight_scale_inv` under the checkpoint's own names, each with a weight_loader, so the generic
    loader copies them as they ship (it must be asked not to dequantize: iter_checkpoint_tensors
    with dequantize_fp8=False);
  - from a float weight at load (`quantization="fp8"` on a bf16 checkpoint): Fp8Linear.quantized,
    one scale per output channel.

Not wired into the models yet: the loader still dequantizes FP8 checkpoints to the model dtype by
default, until the H200 measurements of issue 25 say when the FP8 path wins. Unfused, one rank
(fused q/k/v and gate_up, and tensor-parallel slices of the blocks, are left to the wiring).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from foretell.layers.linear import check_shape, default_weight_loader
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

