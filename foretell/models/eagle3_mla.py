"""An EAGLE3 head whose draft layer uses MLA (its config has kv_lora_rank), as some heads for
DeepSeek-V3 / Kimi-K2.5 targets are trained (vLLM and SGLang call them Eagle3DeepseekV2).

Same checkpoint layout and step as foretell/models/eagle3.py (fc, midlayer.* or layers.0.*,
hidden_norm, norm, lm_head over the draft vocabulary, d2t, optional embed_tokens), except that
midlayer.self_attn holds MLA projections taking the 2H-wide [embedding ; hidden] input:
q_a_proj [q_lora, 2H] (or q_proj [heads * (nope + rope), 2H]), q_a_layernorm, q_b_proj,
kv_a_proj_with_mqa [kv_lora_rank + rope, 2H], kv_a_layernorm, kv_b_proj, o_proj [H, heads * v];
and midlayer.mlp is a dense SiLU MLP of intermediate_size. Its rope is DeepSeek's (interleaved
pairs, the head's own rope_theta / rope_scaling, YaRN softmax correction), and its DraftKVCache
is a latent cache like the target's.
"""

from __future__ import annotations

import torch
from torch import nn

from foretell.layers.embedding import LMHead, VocabEmbedding
from foretell.layers.linear import Linear, make_param
from foretell.layers.mla import MLAAttention, MLADims
from foretell.layers.moe import GatedMLP
from foretell.layers.norm import RMSNorm
from foretell.layers.rotary import RotaryEmbedding, rope_parameters_from_config, yarn_softmax_scale_factor
from foretell.models.base import HFConfig, ModelOptions, WeightRules
from foretell.models.eagle3 import Eagle3Head, Eagle3LayerBase, eagle3_weight_rules


def is_mla_head(config: HFConfig) -> bool:
    return bool(config.get("kv_lora_rank"))


def eagle3_mla_weight_rules(has_embed: bool, has_lm_head: bool) -> WeightRules:
    """EAGLE3's rules without the q/k/v fusion (an MLA layer's q_proj stays q_proj)."""
    rules = eagle3_weight_rules(has_embed, has_lm_head)
    fused = [r for r in rules.fused if "qkv_proj" not in r.replacement]
    return WeightRules(fused=fused, ignored=list(rules.ignored))


class Eagle3MLALayer(Eagle3LayerBase):
    def __init__(self, config: HFConfig, rotary: RotaryEmbedding, scale: float, options: ModelOptions):
        super().__init__()
        kw = dict(dtype=options.dtype, device=options.device)
        hidden, eps = config.hidden_size, config.get("rms_norm_eps", 1e-6)
        self.self_attn = MLAAttention(
            MLADims.from_config(config), rotary, scale, options.attention_backend.name,
            bias=bool(config.get("attention_bias", False)), input_size=2 * hidden, **kw,
        )
        self.mlp = GatedMLP(hidden, config.intermediate_size, bool(config.get("mlp_bias", False)), **kw)
        self.add_norms(config, hidden, eps, **kw)


class Eagle3MLAHead(Eagle3Head):
    """Eagle3Head's interface (combine, forward, compute_logits, target_ids, share) over an MLA
    draft layer; only the construction differs."""

    def __init__(
        self,
        config: HFConfig,
        target_hidden_size: int,
        target_max_positions: int,
        options: ModelOptions,
        has_embed: bool,
        has_lm_head: bool,
    ):
        nn.Module.__init__(self)
        kw = dict(dtype=options.dtype, device=options.device)
        hidden = config.hidden_size
        self.hidden_size = hidden
        self.vocab_size = config.vocab_size
        self.draft_vocab_size = config.get("draft_vocab_size", config.vocab_size)
        theta, scaling = rope_parameters_from_config(config)
        max_pos = max(config.get("max_position_embeddings", 2048), target_max_positions)
        style = "gptj" if config.get("rope_interleave", True) else "neox"
        self.rotary_emb = RotaryEmbedding(config.qk_rope_head_dim, max_pos, theta, scaling, style, device=options.device)
        scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5 * yarn_softmax_scale_factor(scaling)
        self.fc = Linear(3 * target_hidden_size, hidden, **kw)
        self.midlayer = Eagle3MLALayer(config, self.rotary_emb, scale, options)
        self.norm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6), **kw)
        self.embed_tokens = VocabEmbedding(config.vocab_size, hidden, **kw) if has_embed else None
        self.lm_head = LMHead(self.draft_vocab_size, hidden, **kw) if has_lm_head else None
        self.d2t = make_param((self.draft_vocab_size,), torch.int64, options.device)
        self.d2t.dummy_value = 0
        self.weight_rules = eagle3_mla_weight_rules(has_embed, has_lm_head)
        self.shared_embed = None
        self.shared_lm_head = None
