"""Binds one SmallMGemm (ops/gemm/dispatch.py: the few-row Triton GEMMs or cuBLAS, per shape) to
every Linear and LMHead of a model, and decides each shape up front so that a CUDA-graph capture
afterwards finds it decided. The runner calls prepare_small_m_linears on CUDA; mode "off" binds none.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

from foretell.layers.embedding import LMHead
from foretell.layers.linear import Linear
from foretell.ops.common import kernel_choice
from foretell.ops.gemm.dispatch import MODES, GemmKey, SmallMGemm

logger = logging.getLogger("foretell")


def small_m_layers(roots: Iterable[nn.Module]) -> list[tuple[nn.Module, torch.Tensor | None]]:
    """The layers that take a SmallMGemm, with their bias: every Linear (and subclass), LMHead."""
    found = {}  # by id: a module reachable from two roots (a shared lm_head) is bound once
    for root in roots:
        for module in root.modules():
            if isinstance(module, Linear) and not module.is_fp8:  # FP8 layers run their own kernels
                found[id(module)] = (module, module.bias if module.bias_in_gemm else None)
            elif isinstance(module, LMHead):
                found[id(module)] = (module, None)
    return list(found.values())


def prepare_small_m_linears(
    modules: nn.Module | Iterable[nn.Module],
    max_m: int,
    mode: str = "auto",
    gemm: SmallMGemm | None = None,  # tests: one with fakes; None: SmallMGemm(mode, max_m)
) -> SmallMGemm | None:
    """Bind one SmallMGemm to every Linear / LMHead under modules and decide (time) every key
    of M <= max_m up front, so that a CUDA-graph capture afterwards finds them decided.
    Returns it, or None where nothing is bound (mode off, or no weights on CUDA)."""
    if mode not in MODES:
        raise ValueError(f"small_m_gemm must be one of {', '.join(MODES)}, got {mode!r}")
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    layers = [(layer, bias) for layer, bias in small_m_layers(roots) if kernel_choice.use_triton(layer.weight)]
    if mode == "off" or not layers:
        return None
    gemm = gemm or SmallMGemm(mode, max_m)
    # The kernel may read its weight before the kernel launched ahead of it has finished
    # (ops/common/pdl.py): whatever wrote the weights (loading, dummy init) must be done first.
    device = layers[0][0].weight.device
    if device.type == "cuda":  # (interpreter tests bind CPU layers)
        torch.cuda.synchronize(device)
    buckets = [1 << i for i in range(gemm.max_m.bit_length())]  # 1, 2, 4, .., max_m
    with torch.inference_mode():
        for layer, bias in layers:
            layer.small_m = gemm
            weight = layer.weight  # [N, K]
            for m in buckets:
                x = torch.empty(m, weight.shape[1], dtype=weight.dtype, device=weight.device)
                if gemm.applies(x, weight, bias):
                    gemm.choose(GemmKey(m, *weight.shape, x.dtype, bias is not None), weight, bias)
    logger.info("small-M GEMM (%s) for %d layers, M <= %d:\n%s", mode, len(layers), gemm.max_m, gemm.summary())
    return gemm
