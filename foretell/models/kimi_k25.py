"""Kimi-K2.5's checkpoint layout, text only: a DeepSeek-V3 language model under `language_model.`.

config.json: `architectures: [KimiK25ForConditionalGeneration]`, the language model's config
under `text_config` (DeepseekV3ForCausalLM, model_type kimi_k2 or deepseek_v3), the vision
tower's under `vision_config`. Weights: `language_model.model.*`, `language_model.lm_head.weight`,
plus `vision_tower.*` and `mm_projector.*`, which are not loaded: foretell serves Kimi-K2.5 as a
text model (image and video inputs are not supported). Tensor and expert parallel as the inner
DeepSeek-V3 model (the options pass through).
"""

from __future__ import annotations

import torch
from torch import nn

from foretell.ops.attention.metadata import AttentionMetadata
from foretell.models.base import HFConfig, ModelOptions, WeightRules
from foretell.models.deepseek_v2 import DeepseekV3ForCausalLM

PREFIX = "language_model."
VISION_KEYS = (r"^vision_tower\.", r"^mm_projector\.", r"^multi_modal_projector\.")


class KimiK25ForConditionalGeneration(nn.Module):
    def __init__(self, config: HFConfig, options: ModelOptions):
        super().__init__()
        if "text_config" not in config:
            raise ValueError(
                f"{config.source} declares KimiK25ForConditionalGeneration but has no "
                f"'text_config' holding the language model's configuration"
            )
        self.config = config
        self.text_config = config.sub("text_config")
        self.language_model = DeepseekV3ForCausalLM(self.text_config, options)
        self.aux_hidden_state_layers = self.language_model.aux_hidden_state_layers
        inner = self.language_model.weight_rules
        # The inner rules search anywhere in the key, so they work under the prefix unchanged;
        # its anchored ignore patterns (MTP layers, a tied lm_head) are re-anchored here.
        self.weight_rules = WeightRules(
            fused=list(inner.fused),
            ignored=[_under_prefix(p) for p in inner.ignored] + list(VISION_KEYS),
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.language_model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def compute_greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n] int64
        return self.language_model.compute_greedy_tokens(hidden)

    @property
    def splits_vocabulary(self) -> bool:
        return self.language_model.splits_vocabulary

    def attention_layers(self) -> list[nn.Module]:
        return self.language_model.attention_layers()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()


def _under_prefix(pattern: str) -> str:
    return "^" + PREFIX.replace(".", r"\.") + pattern[1:] if pattern.startswith("^") else pattern

