"""An EAGLE3 head's float32 CPU linear weights packed in fp16 for fbgemm's GEMM (issue 32: the
default family's draft loop on a laptop-class CPU).

A draft head's step at batch 1 is a chain of one-row matmuls, each reading its whole weight, and
small ops between them that find the caches emptied by that read. fbgemm's fp16 GEMM
(torch.ops.quantized.linear_dynamic_fp16) takes a float32 input, reads weights rounded to fp16
once at load (half float32's bytes), accumulates in float32 and returns float32. Whether each
output row is computed alone (its bits independent of the rows beside it) depends on the CPU:
on the 2-core Xeon of the CPU bar it is; on an EPYC with AVX2 and no AVX-512 a row's last bits
change with the number of rows (the kernel's row blocks). rows_computed_alone() probes this CPU. That changes drafts only, never the output: the target
verifies them, and the batch-invariant mode never packs. On the 2-core Xeon of the CPU bar it costs less than MKL's float32 product
for the head's wide shapes and leaves more of the caches to the ops after it (the figures are in
the lead's perf log). Bfloat16 checkpoints' values (the default family's) are held exactly in
fp16, except the few below fp16's normal range.

Only drafters get it: their weights only propose tokens, which the target verifies, so greedy
output stays equal to plain decoding whatever bits the drafts come from. The target's weights
never take this path (pack_draft_weights skips every module and weight of the target model, one
it shares with the drafter included).

A bound PackedDraftGemm is the layer's small_m (Linear.matmul, MergedLinear.forward_gated and
LMHead.forward call it): the packed product for float32 CPU inputs outside autograd, F.linear on
the layer's own float32 weight otherwise. draft_weight_format() decides:
FORETELL_CPU_DRAFT_WEIGHTS=fp16 or =fp32 when set, else fp16 wherever fbgemm runs.
"""

from __future__ import annotations

import functools
import os
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

FORMAT_ENV = "FORETELL_CPU_DRAFT_WEIGHTS"
FORMATS = ("fp16", "fp32")  # fp32: no packing (MKL's float32 products)


@functools.lru_cache(maxsize=1)
def packed_gemm_available() -> bool:
    """Whether this torch build runs fbgemm's fp16 GEMM on this CPU (x86 with fbgemm), checked on
    a small product."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    weight = torch.tensor([[1.0, -2.0], [0.5, 0.25]])  # [N, K], exact in fp16
    x = torch.tensor([[2.0, 1.0]])  # [1, K]
    try:
        out = PackedDraftGemm(weight)(x, weight)  # [1, N]
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.equal(out, x @ weight.t()))


@functools.lru_cache(maxsize=1)
def rows_computed_alone() -> bool:
    """Whether fbgemm's fp16 product on this CPU gives every row the same bits at any number of
    rows (1..9 rows against 9 at once, K = 256: covers a micro-kernel's row blocks and its
    remainders); False without fbgemm."""
    if not packed_gemm_available():
        return False
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(128, 256, generator=generator) * 0.05  # [N, K]
    x = torch.randn(9, 256, generator=generator)  # [9, K]
    gemm = PackedDraftGemm(weight)
    together = gemm(x, weight)  # [9, N]
    return all(torch.equal(gemm(x[:m].contiguous(), weight), together[:m]) for m in range(1, 9))


def draft_weight_format() -> str:
    """How an EAGLE3 head's float32 CPU weights are stored: "fp16" (packed) or "fp32"."""
    asked = os.environ.get(FORMAT_ENV, "").strip().lower()
    if asked and asked not in FORMATS:
        raise ValueError(f"{FORMAT_ENV} must be one of {', '.join(FORMATS)}, got {asked!r}")
    if asked == "fp16" and not packed_gemm_available():
        raise ValueError(f"{FORMAT_ENV}=fp16, but this torch build runs no fbgemm fp16 GEMM on this CPU")
    if asked:
        return asked
    return "fp16" if packed_gemm_available() else "fp32"


class PackedDraftGemm:
    """One layer's weight [N, K] packed in fp16 for fbgemm, called as the layer's small_m."""

    def __init__(self, weight: torch.Tensor):  # [N, K] float32 on the CPU
        self.weight_shape = tuple(weight.shape)
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().contiguous(), None)

    def __call__(
        self,
        x: torch.Tensor,  # [..., K]
        weight: torch.Tensor,  # [N, K]: the layer's own float32 weight (F.linear's, where x does not fit)
        bias: torch.Tensor | None = None,  # [N]
        gated: bool = False,  # silu(gate) * up of a [gate; up] output (MergedLinear.forward_gated)
        float32_out: bool = False,  # LMHead asks for float32: the output is float32 either way
    ) -> torch.Tensor:  # [..., N] float32, or [..., N // 2] gated
        if x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad and x.shape[-1] > 0:
            out = torch.ops.quantized.linear_dynamic_fp16(x, self.packed)
            if bias is not None:
                out = out + bias
        else:
            out = F.linear(x, weight, bias)
        if gated:
            from foretell.ops.pointwise.dispatch import silu_and_mul

            out = silu_and_mul(out)
        return out


def pack_draft_weights(roots: Iterable[nn.Module], fmt: str, exclude: nn.Module | None = None) -> int:
    """Bind a PackedDraftGemm to every float32 CPU Linear and LMHead under roots that has no small_m
    yet when fmt is "fp16" (FP8 layers, every module of `exclude` (the target model) and every layer
    holding one of its weights left alone); returns how many were bound (none for "fp32")."""
    from foretell.layers.embedding import LMHead
    from foretell.layers.linear import Linear

    if fmt not in FORMATS:
        raise ValueError(f"draft weight format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "fp32":
        return 0
    skipped = {id(m) for m in exclude.modules()} if exclude is not None else set()
    target_weights = {id(p) for p in exclude.parameters()} if exclude is not None else set()
    bound = 0
    for root in roots:
        for module in root.modules():
            if id(module) in skipped or not isinstance(module, (Linear, LMHead)) or module.small_m is not None:
                continue
            if isinstance(module, Linear) and module.is_fp8:
                continue
            weight = module.weight
            if (id(weight) in target_weights or weight.device.type != "cpu" or weight.dtype != torch.float32
                    or weight.dim() != 2):
                continue
            module.small_m = PackedDraftGemm(weight)
            bound += 1
    return bound
