"""Which model class runs which Hugging Face architecture.

A plain dict from the `architectures` name in config.json to "module:Class". Classes are imported
only when resolved, so a model's heavy imports cost nothing until it is used. Adding a model is
one line here.
"""

from __future__ import annotations

import importlib

from foretell.models.base import HFConfig

MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "foretell.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "foretell.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "foretell.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "foretell.models.llama:Qwen3ForCausalLM",
    "DeepseekV2ForCausalLM": "foretell.models.deepseek_v2:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "foretell.models.deepseek_v2:DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration": "foretell.models.kimi_k25:KimiK25ForConditionalGeneration",
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def resolve_model_class(hf_config: HFConfig) -> type:
    """The class for the first supported name in config.json's `architectures`."""
    architectures = hf_config.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    for name in architectures:
        if name in MODEL_REGISTRY:
            module_name, class_name = MODEL_REGISTRY[name].split(":")
            return getattr(importlib.import_module(module_name), class_name)
    found = f"architectures {architectures}" if architectures else "no 'architectures' field"
    raise ValueError(
        f"{hf_config.source} has {found}, which foretell does not support; supported "
        f"architectures: {', '.join(supported_architectures())}"
    )
