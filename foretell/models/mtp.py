"""DeepSeek's multi-token-prediction (MTP / "nextn") layers, as a drafter.

The target checkpoint carries num_nextn_predict_layers extra layers after its N decoder layers,
`model.layers.{N+i}.*` (DeepSeek-V3/R1: one, model.layers.61):
  enorm, hnorm [H]; eh_proj [H, 2H]; shared_head.norm [H]; shared_head.head [vocab, H];
  embed_tokens [vocab, H] (a copy of the target's: not loaded, the target's is shared);
  a full decoder block (input_layernorm, MLA self_attn, post_attention_layernorm, MoE or dense mlp).

One step, for a row at position t that pairs a hidden state for t with the token x_{t+1}:
  x = eh_proj(concat(enorm(embed(x_{t+1})), hnorm(h)))     embedding first
  out = shared_head.norm(block(x))                          the block's residual stream, normed
  logits = shared_head.head(out)
Step 0 takes the target's final hidden state (after its last norm). A chained step takes the
previous step's `out` (after shared_head.norm, as SGLang's NextN and transformers' MtpModel do;
vLLM feeds it before that norm). Each layer has its own MLA cache, sized like the target's.

Under the target's tensor parallelism (the same options.tensor_parallel and expert_parallel) the
decoder block splits as the target's layers do, shared_head.head is split by vocabulary like the
target's lm_head (compute_logits gathers whole rows, compute_greedy_tokens needs no gather), and
enorm, hnorm and eh_proj ([H, 2H]) are replicated.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from foretell.ops.attention.metadata import AttentionMetadata
from foretell.layers.vocab_parallel import lm_head
from foretell.layers.linear import Linear
from foretell.layers.norm import RMSNorm
from foretell.models.base import HFConfig, ModelOptions, WeightRules
from foretell.models.deepseek_v2 import (
    DeepseekDecoderLayer, deepseek_rotary, deepseek_weight_rules, mtp_layer_indices, other_ranks_expert_keys,
    router_config,
)


class SharedHead(nn.Module):
    def __init__(self, config: HFConfig, options: ModelOptions):
        super().__init__()
        kw = dict(dtype=options.dtype, device=options.device)
        self.norm = RMSNorm(config.hidden_size, config.get("rms_norm_eps", 1e-6), **kw)
        self.head = lm_head(config.vocab_size, config.hidden_size, options.tensor_parallel, **kw)


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """A decoder block plus the MTP projections, under one checkpoint prefix."""

    def __init__(self, config: HFConfig, layer_index: int, rotary, scale, router, options: ModelOptions):
        super().__init__(config, layer_index, rotary, scale, router, options)
        kw = dict(dtype=options.dtype, device=options.device)
        hidden, eps = config.hidden_size, config.get("rms_norm_eps", 1e-6)
        self.enorm = RMSNorm(hidden, eps, **kw)
        self.hnorm = RMSNorm(hidden, eps, **kw)
        self.eh_proj = Linear(2 * hidden, hidden, **kw)
        self.shared_head = SharedHead(config, options)

    def step(
        self,
        positions: torch.Tensor,  # [n]
        embeds: torch.Tensor,  # [n, H] embedding of x_{t+1}
        h_prev: torch.Tensor,  # [n, H]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [n, H] after shared_head.norm
        e, _ = self.enorm(embeds)
        h, _ = self.hnorm(h_prev)
        x = self.eh_proj(torch.cat([e, h], dim=-1))
        hidden, residual = self.forward(positions, x, None, metadata)
        out, _ = self.shared_head.norm(hidden, residual)
        return out


class DeepseekMTP(nn.Module):
    """The MTP layers of a DeepSeek checkpoint; parameter names are the checkpoint keys.

    `prefix` is the language model's key prefix ("" for DeepSeek-V3, "language_model." for the
    Kimi-K2.5 layout); the module tree mirrors it so that names still equal keys.
    """

    def __init__(self, config: HFConfig, options: ModelOptions, prefix: str = "", default_router=("sigmoid", "noaux_tc")):
        super().__init__()
        indices = mtp_layer_indices(config)
        if not indices:
            raise ValueError(
                f"{config.source}: num_nextn_predict_layers is 0 or absent, so this checkpoint has "
                f"no MTP layers to draft with; use method eagle3, draft_model or ngram"
            )
        self.layer_indices = indices
        rotary, scale = deepseek_rotary(config, options.device)
        self.rotary_emb = rotary
        router = router_config(config, *default_router) if config.get("n_routed_experts") else None
        layers = nn.ModuleDict({
            str(i): DeepseekMTPLayer(config, i, rotary, scale, router, options) for i in indices
        })
        holder = self
        for part in (prefix + "model").split("."):
            child = nn.Module()
            holder.add_module(part, child)
            holder = child
        holder.layers = layers
        self._layers = list(layers.values())
        inner = deepseek_weight_rules(config, options=options)
        p = re.escape(prefix)
        ids = "|".join(map(str, indices))
        self.weight_rules = WeightRules(
            fused=list(inner.fused),
            ignored=[
                rf"^(?!{p}model\.layers\.(?:{ids})\.)",  # everything of the target itself
                rf"^{p}model\.layers\.(?:{ids})\.embed_tokens\.weight$",  # the embedding's copy
                r"rotary_emb\.inv_freq$",
            ] + other_ranks_expert_keys(config, options),
        )
        self.embed: nn.Module | None = None
        self.tensor_parallel = options.tensor_parallel

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def share_embedding(self, embedding: nn.Module) -> None:
        # Set past nn.Module's registration so the target's embedding is not loaded or counted
        # as this module's parameter.
        object.__setattr__(self, "embed", embedding)

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn.attn for layer in self._layers]

    def step(self, layer: int, positions, input_ids, h_prev, metadata) -> torch.Tensor:
        embeds = self.embed(input_ids).to(h_prev.dtype)
        return self._layers[layer].step(positions, embeds, h_prev, metadata)

    def compute_logits(self, layer: int, out: torch.Tensor) -> torch.Tensor:  # [n, vocab] f32
        return self._layers[layer].shared_head.head(out)

    def compute_greedy_tokens(self, layer: int, out: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n] int64
        """The argmax of compute_logits' rows; under tensor parallelism without gathering them."""
        head = self._layers[layer].shared_head.head
        if self.tensor_parallel.is_parallel:
            return head.greedy_tokens(out)
        return head(out).argmax(dim=-1)
