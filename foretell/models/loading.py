"""Build a model from a Hugging Face folder: config, class from the registry, weights, dtype."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

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
    load_weights(model, folder, load_format=load_format, seed=seed)
    return model.eval()


def checkpoint_dtype(hf_config: HFConfig) -> str | None:
    return hf_config.get("torch_dtype") or hf_config.get("dtype")
