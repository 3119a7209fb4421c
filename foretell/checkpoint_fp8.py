"""FP8 block-quantized checkpoint tensors as DeepSeek-V3/R1 and Kimi-K2 ship them: `X.weight`
(float8) beside `X.weight_scale_inv` (float32, [ceil(out / b0), ceil(in / b1)], blocks
`quantization_config.weight_block_size`, default 128 x 128), wherever the two sit in the shards.

Fp8Pairing holds one of a pair until its partner arrives (loader.iter_checkpoint_tensors feeds it
every tensor): where the model keeps the weight in FP8 (`keep`) both tensors pass through as they
are, bit for bit; elsewhere the pair becomes one float32 `X.weight`, each block times its scale
(dequantize_fp8_blocks). check_complete() names any weight or scale left without its partner.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

from foretell.checkpoint_errors import CheckpointError, list_names

FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)
FP8_SCALE_SUFFIX = "_scale_inv"
DEFAULT_FP8_BLOCK = (128, 128)


def fp8_block_size(folder: str) -> tuple[int, int]:
    """quantization_config.weight_block_size from config.json (top level or text_config)."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError):
        return DEFAULT_FP8_BLOCK
    for holder in (config, config.get("text_config") or {}):
        block = (holder.get("quantization_config") or {}).get("weight_block_size")
        if block is not None:
            if len(block) != 2 or any(not isinstance(b, int) or b < 1 for b in block):
                raise CheckpointError(
                    f"{path}: quantization_config.weight_block_size must be two positive "
                    f"integers, got {block!r}"
                )
            return tuple(block)
    return DEFAULT_FP8_BLOCK


def dequantize_fp8_blocks(
    weight: torch.Tensor,  # [out, in] float8
    scale_inv: torch.Tensor,  # [ceil(out / b0), ceil(in / b1)]
    block: tuple[int, int],
) -> torch.Tensor:  # [out, in] float32: each block times its scale
    rows, cols = weight.shape
    scales = scale_inv.float()
    scales = scales.repeat_interleave(block[0], dim=0)[:rows]
    scales = scales.repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.float() * scales


class Fp8Pairing:
    """Holds an FP8 weight or a scale until its partner arrives (possibly from another shard)."""

    def __init__(self, folder: str, keep: Callable[[str], bool] | None = None):
        self.folder = folder
        self.keep = keep or (lambda key: False)
        self._block: tuple[int, int] | None = None
        self.weights: dict[str, tuple[torch.Tensor, str]] = {}
        self.scales: dict[str, tuple[torch.Tensor, str]] = {}
        self.kept_weights: dict[str, str] = {}  # weight key -> file, yielded as FP8 (scale not seen yet)
        self.kept_scales: set[str] = set()  # weight keys whose scale was yielded (weight not seen yet)

    @property
    def block(self) -> tuple[int, int]:
        if self._block is None:
            self._block = fp8_block_size(self.folder)
        return self._block

    def add(self, key: str, tensor: torch.Tensor, path: str) -> list[tuple[str, torch.Tensor]]:
        if key.endswith(".weight" + FP8_SCALE_SUFFIX):
            weight_key = key[: -len(FP8_SCALE_SUFFIX)]
            if self.keep(weight_key):
                if self.kept_weights.pop(weight_key, None) is None:
                    self.kept_scales.add(weight_key)
                return [(key, tensor)]
            if weight_key in self.weights:
                weight, _ = self.weights.pop(weight_key)
                return [(weight_key, self._dequantize(weight_key, weight, tensor, path))]
            self.scales[weight_key] = (tensor, path)
            return []
        if tensor.dtype in FP8_DTYPES:
            if self.keep(key):
                if key in self.kept_scales:
                    self.kept_scales.discard(key)
                else:
                    self.kept_weights[key] = path
                return [(key, tensor)]
            if key in self.scales:
                scale, _ = self.scales.pop(key)
                return [(key, self._dequantize(key, tensor, scale, path))]
            self.weights[key] = (tensor, path)
            return []
        return [(key, tensor)]

    def _dequantize(self, key, weight, scale, path) -> torch.Tensor:
        b0, b1 = self.block
        if weight.dim() != 2:
            raise CheckpointError(f"{path}: FP8 tensor {key!r} has shape {tuple(weight.shape)}; "
                                  f"block dequantization needs a 2-D weight")
        expected = (-(-weight.shape[0] // b0), -(-weight.shape[1] // b1))
        if tuple(scale.shape) != expected:
            raise CheckpointError(
                f"{path}: {key + FP8_SCALE_SUFFIX!r} has shape {tuple(scale.shape)}, expected "
                f"{expected} for a {tuple(weight.shape)} weight in {b0}x{b1} blocks "
                f"(quantization_config.weight_block_size)"
            )
        return dequantize_fp8_blocks(weight, scale, (b0, b1))

    def check_complete(self) -> None:
        unpaired = {key: path for key, (_, path) in self.weights.items()} | self.kept_weights
        if unpaired:
            keys = sorted(unpaired)
            raise CheckpointError(
                f"checkpoint in {self.folder} has FP8 tensor(s) without a "
                f"'{FP8_SCALE_SUFFIX}' scale: {list_names(keys)} (in "
                f"{os.path.basename(unpaired[keys[0]])}); foretell reads block-quantized "
                f"FP8 (weight + weight_scale_inv) only"
            )
        if self.scales or self.kept_scales:
            keys = sorted(k + FP8_SCALE_SUFFIX for k in set(self.scales) | self.kept_scales)
            raise CheckpointError(
                f"checkpoint in {self.folder} has scale(s) without an FP8 weight: "
                f"{list_names(keys)}"
            )
