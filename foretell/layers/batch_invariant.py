"""Puts a model into the batch-invariant mode (ModelConfig.batch_invariant, issue 23): binds
ops/gemm/batch_invariant.BatchInvariantGemm to every float Linear and LMHead (in the place a
SmallMGemm takes otherwise: layers/linear.py), and marks the MoE routers and float packed experts so
that their dispatch (ops/moe/dispatch.py) picks the fixed-order forms. The attention layers get
their batch-invariant backend when it is built (ops/attention/dispatch.build_attention_backend).

The runner calls it once, after loading, on the target and the drafter's modules. What stays
outside the mode: FP8 and int4 layers (their own kernels), noted in the README.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from foretell.layers.embedding import LMHead
from foretell.layers.linear import Linear
from foretell.layers.moe import Router
from foretell.layers.packed_experts import PackedExperts
from foretell.ops.gemm.batch_invariant import BatchInvariantGemm


def prepare_batch_invariant(modules: nn.Module | Iterable[nn.Module]) -> BatchInvariantGemm:
    """Bind the mode's GEMM to every float Linear / LMHead under modules and mark every Router
    and float PackedExperts; returns the GEMM (one object: it holds no state)."""
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    gemm = BatchInvariantGemm()
    for root in roots:
        for module in root.modules():
            if isinstance(module, Linear) and not module.is_fp8:
                module.small_m = gemm
            elif isinstance(module, LMHead):
                module.small_m = gemm
            elif isinstance(module, Router) or (isinstance(module, PackedExperts) and module.format == "float"):
                module.batch_invariant = True
    return gemm
