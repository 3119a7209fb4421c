"""DeepSeek-V2 / V2-Lite and DeepSeek-V3 / R1 (and Kimi-K2, the same architecture): MLA
attention (foretell/layers/mla.py) and DeepSeek MoE (foretell/layers/moe.py).

Differences between the two classes are defaults only: V2 routes with softmax scores ("greedy" or
"group_limited_greedy"), V3 with sigmoid scores plus e_score_correction_bias ("noaux_tc"); either
reads `scoring_func` / `topk_method` from config.json when present. Layer L is MoE when
n_routed_experts is set, L >= first_k_dense_replace and L % moe_layer_freq == 0, else a dense MLP
of intermediate_size. `q_lora_rank: null` (V2-Lite) means one q_proj instead of q_a/q_b.

RoPE covers only the qk_rope_head_dim part of q and the shared k_pe, in DeepSeek's interleaved
pair layout ("gptj"; a config with `rope_interleave: false` gets "neox"), with YaRN when
rope_scaling says so; the softmax scale gets YaRN's m(mscale_all_dim)^2.

Checkpoint keys are the published ones. The loader packs experts and fuses gate/up and MLA's
q/kv_a projections through `deepseek_weight_rules`; the target ignores its MTP layers `model.layers.{N+i}.*`
(num_nextn_predict_layers of them), which foretell/models/mtp.py loads for "method": "mtp".
A `prefix` (Kimi-K2.5's "language_model.") is put before every key pattern.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from foretell.ops.attention.metadata import AttentionMetadata
from foretell.layers.embedding import VocabEmbedding
from foretell.layers.mla import MLAAttention, MLADims
from foretell.layers.moe import GatedMLP, MoE, expert_weight_rules
from foretell.ops.moe.reference import RouterConfig
from foretell.layers.norm import RMSNorm
from foretell.layers.rotary import RotaryEmbedding, rope_parameters_from_config, yarn_softmax_scale_factor
from foretell.models.base import (
    CausalLM,
    HFConfig,
    ModelOptions,
    PreNormDecoderLayer,
    WeightRule,
    WeightRules,
    run_decoder_stack,
)


def router_config(config: HFConfig, default_scoring: str, default_topk_method: str) -> RouterConfig:
    try:
        return RouterConfig(
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok,
            scoring_func=config.get("scoring_func", default_scoring),
            topk_method=config.get("topk_method", default_topk_method),
            n_group=config.get("n_group", 1),
            topk_group=config.get("topk_group", 1),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            num_shared_experts=int(config.get("n_shared_experts", 0) or 0),
        )
    except ValueError as e:
        raise ValueError(f"{config.source}: {e}") from e


def is_moe_layer(config: HFConfig, layer: int) -> bool:
    return (
        bool(config.get("n_routed_experts"))
        and layer >= config.get("first_k_dense_replace", 0)
        and layer % config.get("moe_layer_freq", 1) == 0
    )


def deepseek_rotary(config: HFConfig, device, max_positions: int | None = None) -> tuple[RotaryEmbedding, float]:
    """The rope-part rotary embedding and the softmax scale of a DeepSeek attention layer (its
    table over max_positions, by default the config's max_position_embeddings)."""
    theta, scaling = rope_parameters_from_config(config)
    style = "gptj" if config.get("rope_interleave", True) else "neox"
    rotary = RotaryEmbedding(
        config.qk_rope_head_dim, max_positions or config.max_position_embeddings, theta, scaling, style,
        device=device,
    )
    head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    return rotary, head_dim**-0.5 * yarn_softmax_scale_factor(scaling)


class DeepseekDecoderLayer(PreNormDecoderLayer):
    """Pre-norm MLA + (MoE or dense MLP); (hidden, residual) in and out as in llama.py."""

    def __init__(
        self,
        config: HFConfig,
        layer_index: int,
        rotary: RotaryEmbedding,
        scale: float,
        router: RouterConfig | None,
        options: ModelOptions,
    ):
        super().__init__()
        kw = dict(dtype=options.dtype, device=options.device)
        hidden = config.hidden_size
        eps = config.get("rms_norm_eps", 1e-6)
        self.self_attn = MLAAttention(
            MLADims.from_config(config), rotary, scale, options.attention_backend.name,
            bias=bool(config.get("attention_bias", False)), **kw,
        )
        if router is not None and is_moe_layer(config, layer_index):
            self.mlp = MoE(router, hidden, config.moe_intermediate_size, **kw)
        else:
            self.mlp = GatedMLP(hidden, config.intermediate_size, bool(config.get("mlp_bias", False)), **kw)
        self.input_layernorm = RMSNorm(hidden, eps, **kw)
        self.post_attention_layernorm = RMSNorm(hidden, eps, **kw)


class DeepseekModel(nn.Module):
    """The checkpoint's `model.` part: embeddings, decoder layers, final norm."""

    def __init__(self, config: HFConfig, router: RouterConfig | None, options: ModelOptions):
        super().__init__()
        kw = dict(dtype=options.dtype, device=options.device)
        self.rotary_emb, scale = deepseek_rotary(config, options.device)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, i, self.rotary_emb, scale, router, options)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.get("rms_norm_eps", 1e-6), **kw)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        metadata: AttentionMetadata,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return run_decoder_stack(
            self.embed_tokens, self.layers, self.norm, input_ids, positions, metadata, aux_layers
        )


def mtp_layer_indices(config: HFConfig) -> list[int]:
    first = config.num_hidden_layers
    return list(range(first, first + int(config.get("num_nextn_predict_layers", 0) or 0)))


def fused_qkv_a_rules(where: str = r"\.self_attn\.", to: str = ".self_attn.") -> list[WeightRule]:
    """MLA's q_proj (or q_a_proj) and kv_a_proj_with_mqa fill shards 0 and 1 of fused_qkv_a_proj;
    `where` matches the attention module's prefix in a checkpoint name, `to` replaces it."""
    return [
        WeightRule(where + r"q_(?:a_)?proj\.", to + "fused_qkv_a_proj.", 0),
        WeightRule(where + r"kv_a_proj_with_mqa\.", to + "fused_qkv_a_proj.", 1),
    ]


def deepseek_weight_rules(config: HFConfig, prefix: str = "", tie: bool = False) -> WeightRules:
    p = re.escape(prefix)
    fused = expert_weight_rules() + fused_qkv_a_rules() + [
        WeightRule(r"\.gate_proj\.", ".gate_up_proj.", 0),  # dense MLP and shared experts
        WeightRule(r"\.up_proj\.", ".gate_up_proj.", 1),
    ]
    ignored = [r"rotary_emb\.inv_freq$"]
    mtp = mtp_layer_indices(config)
    if mtp:
        ignored.append(rf"^{p}model\.layers\.(?:{'|'.join(map(str, mtp))})\.")
    if tie:
        ignored.append(rf"^{p}lm_head\.weight$")
    return WeightRules(fused=fused, ignored=ignored)


class DeepseekV2ForCausalLM(CausalLM):
    default_scoring_func = "softmax"
    default_topk_method = "greedy"

    def __init__(self, config: HFConfig, options: ModelOptions):
        super().__init__(config, options)
        router = (
            router_config(config, self.default_scoring_func, self.default_topk_method)
            if config.get("n_routed_experts") else None
        )
        self.model = DeepseekModel(config, router, options)
        self.attach_lm_head(config.hidden_size)
        self.weight_rules = deepseek_weight_rules(config, tie=self.tie_word_embeddings)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 and Kimi-K2 (model_type kimi_k2)."""

    default_scoring_func = "sigmoid"
    default_topk_method = "noaux_tc"
