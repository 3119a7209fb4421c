"""How a model holds its weights in low precision (issue 25): `QuantizedWeights`, decided once per
model from its checkpoint's quantization_config and the user's `quantization` (models/quantization.py)
and read by the layers as they build their parameters.

Three layouts, each kept as it ships (never dequantized to the model dtype at load):
  - FP8 block weights (DeepSeek-V3/R1, Kimi-K2: quant_method "fp8"): every dense projection
    (attention, MLP, shared experts) and the routed experts hold float8_e4m3fn `weight` with
    float32 `weight_scale_inv` per `fp8_block` (rows, columns) block;
  - FP8 quantized at load (`quantization="fp8"` on a float checkpoint): the linears and the
    routed experts are loaded in the model dtype, then quantized into the same block layout
    (layers/quantized_linear.quantize_model_fp8_), so they run the same kernels;
  - int4 routed experts (Kimi-K2.5: compressed-tensors "pack-quantized", group of `int4_group`):
    `weight_packed` int32 and `weight_scale`; the rest of the model is float.
No torch import: this is configuration only.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("fp8",)  # what `quantization=` accepts


@dataclass(frozen=True)
class QuantizedWeights:
    method: str  # "fp8" | "compressed-tensors": what the checkpoint says, or the user asked for
    # FP8 linears and experts built as the checkpoint ships them (weight + weight_scale_inv).
    fp8_block: tuple[int, int] | None = None
    # quantization="fp8" on a float checkpoint: block of the FP8 layout made after loading.
    quantize_at_load_block: tuple[int, int] | None = None
    # int4 routed experts (compressed-tensors pack-quantized, symmetric): columns per scale.
    int4_group: int | None = None

    def __post_init__(self) -> None:
        for name in ("fp8_block", "quantize_at_load_block"):
            block = getattr(self, name)
            if block is not None and (len(block) != 2 or any(not isinstance(b, int) or b < 1 for b in block)):
                raise ValueError(f"{name} must be two positive integers (rows, columns), got {block!r}")
        if self.int4_group is not None and self.int4_group < 1:
            raise ValueError(f"int4_group must be >= 1, got {self.int4_group}")

    @property
    def linear_fp8_block(self) -> tuple[int, int] | None:
        """The block of the FP8 linears built from the checkpoint (None: float linears)."""
        return self.fp8_block
