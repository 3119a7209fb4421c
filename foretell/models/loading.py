"""Build a model from a Hugging Face folder: config, class from the registry, weights, dtype, and the
low-precision layout (options.quantization: FP8 and int4 checkpoints load as they ship; a float
checkpoint with quantization="fp8" is quantized here, after loading)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from foretell.layers.quantized_linear import quantize_model_fp8_
from foretell.loader import load_weights
from foretell.models.base import HFConfig, ModelOptions
from foretell.models.registry import resolve_model_class


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Temporarily create tensors in dtype by default (for layers that do not take a dtype)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    folder: str | None,
    hf_config: HFConfig,
    options: ModelOptions,
    load_format: str = "auto",
    seed: int = 0,
) -> nn.Module:
    model_class = resolve_model_class(hf_config)
    # Layers take dtype and device from options: parameters are created where they live.
    model = model_class(hf_config, options)
    load_model_weights(model, folder, options, load_format, seed)
    return model.eval()


def load_model_weights(model: nn.Module, folder: str | None, options: ModelOptions, load_format: str = "auto",
                       seed: int = 0) -> list[str]:
    """load_weights, then the quantization at load that options ask for (quantization="fp8" on a
    float checkpoint); the files read."""
    files = load_weights(model, folder, load_format=load_format, seed=seed)
    quantization = options.quantization
    if quantization is not None and quantization.quantize_at_load_block is not None:
        quantize_model_fp8_(model, quantization.quantize_at_load_block)
    return files


def checkpoint_dtype(hf_config: HFConfig) -> str | None:
    return hf_config.get("torch_dtype") or hf_config.get("dtype")
