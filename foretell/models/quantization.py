"""A checkpoint's quantization_config and the user's `quantization` -> the QuantizedWeights a model is
built with (layers/quantization.py), or None for a float model; every unsupported combination is
a ValueError naming config.json's field and what is expected.

Read from config.json (top level, or text_config for multimodal layouts such as Kimi-K2.5):
  quant_method "fp8" (DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8): fmt "e4m3", activation_scheme
      "dynamic", weight_block_size [b0, b1] (128 x 128 in every published checkpoint). Per-tensor
      FP8 (no weight_block_size) is not supported.
  quant_method "compressed-tensors" (Kimi-K2.5): format "pack-quantized", one config group of
      weights {num_bits 4, type "int", symmetric true, strategy "group", group_size 32} and no
      activation quantization; `ignore` lists the float modules (attention, shared experts, dense
      MLPs, lm_head): foretell holds the routed experts in int4 and everything else in float.
`quantization="fp8"` on a float checkpoint quantizes its linears and experts at load into
128 x 128 blocks; on an FP8 checkpoint it changes nothing; on another method it is an error.
"""

from __future__ import annotations

from typing import Any

from foretell.layers.quantization import METHODS, QuantizedWeights
from foretell.models.base import HFConfig

QUANTIZE_AT_LOAD_BLOCK = (128, 128)


def checkpoint_quantization_config(hf_config: HFConfig) -> tuple[dict[str, Any] | None, str]:
    """(quantization_config, where it was found) from config.json or its text_config."""
    holders = [(hf_config, hf_config.source)]
    if "text_config" in hf_config:
        holders.append((hf_config.sub("text_config"), hf_config.source + ":text_config"))
    for holder, where in holders:
        qc = holder.get("quantization_config")
        if qc:
            if not isinstance(qc, dict):
                raise ValueError(f"{where}: quantization_config must be an object, got {qc!r}")
            return qc, where
    return None, hf_config.source


def _fp8_block_checkpoint(qc: dict[str, Any], where: str) -> QuantizedWeights:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{where}: quantization_config.fmt is {fmt!r}; foretell reads FP8 e4m3 checkpoints only")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"{where}: quantization_config.activation_scheme is {scheme!r}; foretell reads FP8 "
                         f"checkpoints with dynamic activation scales only")
    block = qc.get("weight_block_size")
    if block is None:
        raise ValueError(f"{where}: an FP8 checkpoint without quantization_config.weight_block_size (per-tensor "
                         f"FP8) is not supported; foretell reads block-quantized FP8 (weight + weight_scale_inv)")
    if not isinstance(block, list | tuple) or len(block) != 2 or any(not isinstance(b, int) or b < 1 for b in block):
        raise ValueError(f"{where}: quantization_config.weight_block_size must be two positive integers, "
                         f"got {block!r}")
    return QuantizedWeights("fp8", fp8_block=(block[0], block[1]))


def _int4_pack_quantized(qc: dict[str, Any], where: str) -> QuantizedWeights:
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        raise ValueError(f"{where}: compressed-tensors format {fmt!r} is not supported; foretell reads "
                         f"'pack-quantized' int4 experts (Kimi-K2.5)")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"{where}: quantization_config.config_groups must hold one group (int4 weights), "
                         f"found {sorted(groups)}")
    (name, group), = groups.items()
    weights = group.get("weights") or {}
    want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    wrong = {k: weights.get(k) for k, v in want.items() if weights.get(k) != v}
    if wrong or group.get("input_activations") is not None:
        raise ValueError(f"{where}: config_groups.{name} must quantize weights only, as {want} with a group_size; "
                         f"found weights {weights} and input_activations {group.get('input_activations')}")
    group_size = weights.get("group_size")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{where}: config_groups.{name}.weights.group_size must be a positive integer, got "
                         f"{group_size!r}")
    return QuantizedWeights("compressed-tensors", int4_group=group_size)


def resolve_quantization(hf_config: HFConfig, requested: str | None = None) -> QuantizedWeights | None:
    """What the model holds in low precision (module docstring)."""
    if requested is not None and requested not in METHODS:
        raise ValueError(f"quantization must be None or one of {', '.join(METHODS)}, got {requested!r}")
    qc, where = checkpoint_quantization_config(hf_config)
    if qc is None:
        return QuantizedWeights("fp8", quantize_at_load_block=QUANTIZE_AT_LOAD_BLOCK) if requested == "fp8" else None
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_block_checkpoint(qc, where)
    if requested is not None:
        raise ValueError(f"{where}: the checkpoint is already quantized (quant_method {method!r}); "
                         f"quantization={requested!r} applies to float checkpoints: leave it unset")
    if method == "compressed-tensors":
        return _int4_pack_quantized(qc, where)
    raise ValueError(f"{where}: quantization_config.quant_method {method!r} is not supported; foretell reads "
                     f"'fp8' (block-quantized) and 'compressed-tensors' (int4 pack-quantized experts) checkpoints")
