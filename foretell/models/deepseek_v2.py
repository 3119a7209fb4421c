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

Tensor parallel (options.tensor_parallel): MLA's heads split (layers/mla.py), the MoE experts
split inside each expert or, with options.expert_parallel, partitioned over the ranks
(layers/moe.py), dense MLPs column/row-parallel, embedding and lm_head split by vocabulary.
The sizes that must divide are checked at construction with config.json's field names.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from foretell.ops.attention.metadata import AttentionMetadata
from foretell.layers.attention.kv_scales import kv_scale_rules
from foretell.layers.mla import MLAAttention, MLADims
from foretell.layers.moe import GatedMLP, MoE, expert_weight_rules, other_ranks_experts_pattern
from foretell.layers.packed_experts import INT4_SHAPE_KEYS
from foretell.layers.vocab_parallel import vocab_embedding
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
    check_tensor_parallel_sizes,
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
        tp = options.tensor_parallel
        hidden = config.hidden_size
        eps = config.get("rms_norm_eps", 1e-6)
        fp8 = options.fp8_block
        self.self_attn = MLAAttention(
            MLADims.from_config(config), rotary, scale, options.attention_backend.name,
            bias=bool(config.get("attention_bias", False)), tp=tp, fp8_block=fp8, **kw,
        )
        if router is not None and is_moe_layer(config, layer_index):
            self.mlp = MoE(router, hidden, config.moe_intermediate_size, tp=tp,
                           expert_parallel=options.expert_parallel, fp8_block=fp8, int4_group=options.int4_group, **kw)
        else:
            self.mlp = GatedMLP(hidden, config.intermediate_size, bool(config.get("mlp_bias", False)), tp=tp,
                                fp8_block=fp8, **kw)
        self.input_layernorm = RMSNorm(hidden, eps, **kw)
        self.post_attention_layernorm = RMSNorm(hidden, eps, **kw)


class DeepseekModel(nn.Module):
    """The checkpoint's `model.` part: embeddings, decoder layers, final norm."""

    def __init__(self, config: HFConfig, router: RouterConfig | None, options: ModelOptions):
        super().__init__()
        kw = dict(dtype=options.dtype, device=options.device)
        check_deepseek_parallel_sizes(config, options)
        self.rotary_emb, scale = deepseek_rotary(config, options.device)
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, options.tensor_parallel, **kw)
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


def check_deepseek_parallel_sizes(config: HFConfig, options: ModelOptions) -> None:
    """The sizes split over tensor-parallel ranks divide by tensor_parallel_size (one error naming
    config.json and every field that does not)."""
    tp = options.tensor_parallel
    sizes = {"num_attention_heads": config.num_attention_heads}
    moe = bool(config.get("n_routed_experts"))
    num_layers = config.num_hidden_layers + int(config.get("num_nextn_predict_layers", 0) or 0)
    if not moe or any(not is_moe_layer(config, i) for i in range(num_layers)):
        sizes["intermediate_size"] = config.intermediate_size
    if moe and options.expert_parallel:
        sizes["n_routed_experts"] = config.n_routed_experts
        shared = int(config.get("n_shared_experts", 0) or 0)
        if shared:
            sizes["n_shared_experts * moe_intermediate_size"] = shared * config.moe_intermediate_size
    elif moe:
        sizes["moe_intermediate_size"] = config.moe_intermediate_size
    check_tensor_parallel_sizes(config, tp, sizes)


def other_ranks_expert_keys(config: HFConfig, options: ModelOptions | None) -> list[str]:
    """Under expert parallelism (several ranks, a MoE model): the ignore pattern of the routed
    experts other ranks hold; else none."""
    if options is None or not (options.expert_parallel and options.tensor_parallel.is_parallel):
        return []
    if not config.get("n_routed_experts"):
        return []
    return [other_ranks_experts_pattern(config.n_routed_experts, options.tensor_parallel)]


def deepseek_weight_rules(config: HFConfig, prefix: str = "", tie: bool = False,
                          options: ModelOptions | None = None) -> WeightRules:
    """The checkpoint -> parameter rules; with options under expert parallelism the shared experts
    stay unpacked and the other ranks' experts are ignored (never read)."""
    p = re.escape(prefix)
    other_experts = other_ranks_expert_keys(config, options)
    int4_experts = options is not None and options.int4_group is not None  # shared experts kept apart
    fused = kv_scale_rules(r"\.self_attn\.", ".self_attn.attn.kv_scales.")  # FP8 latent cache scale, when calibrated
    fused += expert_weight_rules(pack_shared=not other_experts and not int4_experts) + fused_qkv_a_rules() + [
        WeightRule(r"\.gate_proj\.", ".gate_up_proj.", 0),  # dense MLP and shared experts
        WeightRule(r"\.up_proj\.", ".gate_up_proj.", 1),
    ]
    ignored = [r"rotary_emb\.inv_freq$", INT4_SHAPE_KEYS] + other_experts
    mtp = mtp_layer_indices(config)
    if mtp:
        ignored.append(rf"^{p}model\.layers\.(?:{'|'.join(map(str, mtp))})\.")
    if tie:
        ignored.append(rf"^{p}lm_head\.weight$")
    return WeightRules(fused=fused, ignored=ignored)


class DeepseekV2ForCausalLM(CausalLM):
    supports_tensor_parallel = True
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
        self.weight_rules = deepseek_weight_rules(config, tie=self.tie_word_embeddings, options=options)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 and Kimi-K2 (model_type kimi_k2)."""

    default_scoring_func = "sigmoid"
    default_topk_method = "noaux_tc"
