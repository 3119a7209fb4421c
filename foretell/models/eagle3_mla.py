"""An EAGLE3 head whose draft layer uses MLA (its config has kv_lora_rank), as some heads for
DeepSeek-V3 / Kimi-K2.5 targets are trained (vLLM and SGLang call them Eagle3DeepseekV2).

Same checkpoint layout and step as foretell/models/eagle3.py (fc, midlayer.* or layers.0.*,
hidden_norm, norm, lm_head over the draft vocabulary, d2t, optional embed_tokens), except that
midlayer.self_attn holds MLA projections taking the 2H-wide [embedding ; hidden] input:
q_a_proj [q_lora, 2H] (or q_proj [heads * (nope + rope), 2H]), q_a_layernorm, q_b_proj,
kv_a_proj_with_mqa [kv_lora_rank + rope, 2H], kv_a_layernorm, kv_b_proj, o_proj [H, heads * v];
and midlayer.mlp is a dense SiLU MLP of intermediate_size. Its rope is DeepSeek's (interleaved
pairs, the head's own rope_theta / rope_scaling, YaRN softmax correction), and its DraftKVCache
is a latent cache like the target's. A catch-up whose rows draft nothing caches their latents
alone (cache_latents: the kv_a projection, its norm, k_pe's RoPE and the write).

Tensor parallel (draft_tensor_parallel_size = the target's tensor_parallel_size): the MLA
projections split as in the DeepSeek target (q_b_proj or q_proj and kv_b_proj by heads, o_proj
row-parallel; q_a / kv_a_proj_with_mqa whole, so every rank caches the same latent), the MLP's
gate_up column- and down row-parallel; fc, embed_tokens and lm_head as in eagle3.py.
"""

from __future__ import annotations

import torch
from torch import nn

from foretell.layers.attention.kv_only import trailing_projection
from foretell.layers.mla import MLAAttention, MLADims
from foretell.layers.moe import GatedMLP
from foretell.layers.rotary import RotaryEmbedding
from foretell.models.base import HFConfig, ModelOptions, WeightRules, check_tensor_parallel_sizes
from foretell.models.deepseek_v2 import deepseek_rotary, fused_qkv_a_rules
from foretell.models.eagle3 import HEAD_LAYER, Eagle3Head, Eagle3LayerBase, eagle3_weight_rules
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.mla.reference import TorchMLABackend, latent_write_torch


def is_mla_head(config: HFConfig) -> bool:
    return bool(config.get("kv_lora_rank"))


def cache_latents(
    attention: MLAAttention,
    positions: torch.Tensor,  # [n]
    x: torch.Tensor,  # [n, 2H]
    metadata: AttentionMetadata,
) -> None:
    """What MLAAttention.forward writes to its latent cache, and nothing else: the kv_a rows of
    fused_qkv_a_proj (layers/attention/kv_only.trailing_projection), then the latent norm, k_pe's
    RoPE and the write, as the backend's attend_projections runs them (no queries, attention or
    o_proj)."""
    latent = attention.attn
    if latent.kv_cache is None:
        raise RuntimeError("MLA layer has no KV cache bound; the runner must bind one")
    kv_a = trailing_projection(attention.fused_qkv_a_proj, x, attention.q_size)  # [n, kv_lora_rank + rope]
    k_scale = latent.kv_scales.values[0]
    if isinstance(latent.backend, TorchMLABackend):
        latent_write_torch(kv_a, positions, attention.kv_a_layernorm, attention.rotary_emb, latent.kv_cache,
                           metadata.slot_mapping, k_scale)
        return
    from foretell.ops.mla.triton_latent_write import latent_write_triton  # imports triton: CUDA only

    metadata.check_cache_block_size(latent.kv_cache.shape[1], "MLA cache")
    latent_write_triton(kv_a, positions, attention.kv_a_layernorm, attention.rotary_emb, latent.kv_cache,
                        metadata.slot_mapping, k_scale)


def eagle3_mla_weight_rules(has_embed: bool, has_lm_head: bool) -> WeightRules:
    """EAGLE3's rules with MLA's q/kv_a fusion in place of the q/k/v one."""
    rules = eagle3_weight_rules(has_embed, has_lm_head)
    fused = fused_qkv_a_rules(HEAD_LAYER + r"self_attn\.", "midlayer.self_attn.")
    fused += [r for r in rules.fused if "qkv_proj" not in r.replacement]
    return WeightRules(fused=fused, ignored=list(rules.ignored))


class Eagle3MLALayer(Eagle3LayerBase):
    def __init__(self, config: HFConfig, rotary: RotaryEmbedding, scale: float, options: ModelOptions):
        super().__init__()
        kw = dict(dtype=options.dtype, device=options.device)
        tp = options.tensor_parallel
        hidden, eps = config.hidden_size, config.get("rms_norm_eps", 1e-6)
        self.self_attn = MLAAttention(
            MLADims.from_config(config), rotary, scale, options.attention_backend.name,
            bias=bool(config.get("attention_bias", False)), input_size=2 * hidden, tp=tp, **kw,
        )
        self.mlp = GatedMLP(hidden, config.intermediate_size, bool(config.get("mlp_bias", False)), tp=tp, **kw)
        self.add_norms(config, hidden, eps, **kw)

    def cache_kv(self, positions, input_ids, embedding, g, metadata) -> None:  # Eagle3LayerBase.cache_kv's
        x, _ = self.layer_input(input_ids, embedding, g)  # [n, 2H]
        cache_latents(self.self_attn, positions, x, metadata)


class Eagle3MLAHead(Eagle3Head):
    """Eagle3Head's interface (combine, forward, compute_logits, target_ids, share) over an MLA
    draft layer; only the construction differs."""

    def check_tensor_parallel(self, config: HFConfig) -> None:
        check_tensor_parallel_sizes(config, self.tensor_parallel, {
            "num_attention_heads": config.num_attention_heads, "intermediate_size": config.intermediate_size})

    def build_layer(self, config: HFConfig, max_pos: int, options: ModelOptions) -> tuple[RotaryEmbedding, nn.Module]:
        rotary, scale = deepseek_rotary(config, options.device, max_pos)  # DeepSeek's rope and scale
        return rotary, Eagle3MLALayer(config, rotary, scale, options)

    def build_weight_rules(self, has_embed: bool, has_lm_head: bool) -> WeightRules:
        return eagle3_mla_weight_rules(has_embed, has_lm_head)
