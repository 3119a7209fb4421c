"""The per-layer scales of an FP8 KV cache: k_scale and v_scale as optional checkpoint parameters.

An attention layer (GQA `Attention`, MLA `LatentAttention`) holds a `KVScales` module, so its
scales are parameters named `<layer>.kv_scales.k_scale` / `.v_scale`: scalar float32, 1.0 until a
checkpoint sets them. They are optional for the loader (no shard is required, so a checkpoint
without them loads as before) and dummy weights leave them at 1.0. `kv_scale_rules` maps the
names calibrated checkpoints use onto them (vLLM reads the same spellings):
  <attn>.k_scale, <attn>.v_scale                     llm-compressor / compressed-tensors
  <attn>.k_proj.k_scale, <attn>.v_proj.v_scale       ModelOpt
  <attn>.k_proj.output_scale, <attn>.v_proj.output_scale   older FP8 checkpoints, Quark
A model that wants them puts those rules first in its WeightRules.fused (before the q/k/v fusing
rules, which would otherwise claim `k_proj.*`).

The kernels take the scales as host floats: `freeze()` reads them once, when the layer's cache is
bound (after loading, before any CUDA graph is captured), and checks them when the cache is FP8
(a cache in the model's dtype ignores them).
"""

from __future__ import annotations

import torch
from torch import nn

from foretell.ops.attention.fp8_kv import check_scale, is_fp8
from foretell.weight_rules import WeightRule


def _load_scale(param: nn.Parameter, tensor: torch.Tensor, shard=None) -> None:
    if tensor.numel() != 1:
        raise ValueError(f"a KV cache scale must hold one value (per-tensor), got shape {list(tensor.shape)}")
    value = float(tensor.reshape(()).float())
    check_scale("the KV cache scale", value)
    with torch.no_grad():
        param.fill_(value)


def _scale_parameter() -> nn.Parameter:
    param = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
    param.weight_loader = _load_scale
    param.shard_ids = ()  # optional: a checkpoint without scales leaves 1.0
    param.dummy_value = 1.0
    return param


class KVScales(nn.Module):
    """k_scale and v_scale of one layer's FP8 KV cache (1.0 unless the checkpoint has them)."""

    def __init__(self):
        super().__init__()
        self.k_scale = _scale_parameter()
        self.v_scale = _scale_parameter()
        self.values: tuple[float, float] = (1.0, 1.0)  # (k_scale, v_scale) as the kernels take them

    def freeze(self, cache_dtype: torch.dtype) -> None:
        """Read the parameters into `values` (once the weights are loaded) for an FP8 cache; any
        other cache ignores them, and gets (1.0, 1.0)."""
        if not is_fp8(cache_dtype):
            self.values = (1.0, 1.0)
            return
        self.values = (check_scale("k_scale", self.k_scale.item()), check_scale("v_scale", self.v_scale.item()))

    def extra_repr(self) -> str:
        return f"k_scale={self.values[0]:g}, v_scale={self.values[1]:g}"


def kv_scale_rules(attn: str, to: str) -> list[WeightRule]:
    """Rules taking a layer's checkpoint scales (under the regex `attn`, e.g. r"\\.self_attn\\.")
    onto its KVScales (under `to`, e.g. ".self_attn.attn.kv_scales.")."""
    return [
        WeightRule(attn + r"(?:k_proj\.)?k_scale$", to + "k_scale"),
        WeightRule(attn + r"(?:v_proj\.)?v_scale$", to + "v_scale"),
        WeightRule(attn + r"k_proj\.output_scale$", to + "k_scale"),
        WeightRule(attn + r"v_proj\.output_scale$", to + "v_scale"),
    ]
