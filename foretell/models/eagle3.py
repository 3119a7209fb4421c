"""The EAGLE3 draft head: one decoder layer over [embedding ; fused target features].

Checkpoint layouts (both load): EAGLE / AngelSlim name the layer `midlayer.*` and ship no
`embed_tokens` (the target's embedding is shared); SpecForge / speculators name it `layers.0.*`
and may ship their own `embed_tokens`. Tensors: fc [H, 3*Ht], the layer (q/k/v take 2H inputs),
hidden_norm, norm, lm_head [draft_vocab, H], d2t [draft_vocab] (target_id = draft_id + d2t[id]);
t2d is not needed at inference and is ignored.

One draft step (rows pair the target's features at position t with the token at t+1):
  g = fc(concat(aux_low, aux_mid, aux_high))        on the first step; later steps: previous h
  x = concat(input_layernorm(embed(token)), hidden_norm(g))     [n, 2H], embedding first
  h = g + o_proj(attention(x))          (residual = hidden_norm(g) with norm_before_residual)
  h = h + mlp(post_attention_layernorm(h))
  logits = lm_head(norm(h)) over the draft vocabulary; the next step gets h (before the norm)

On CUDA the x line (embedding gather, two norms, concatenation) is one launch
(ops/pointwise/triton_eagle3_input.py). The drafter (spec_decode/eagle3.py) runs `step`: the last add is
fused into the final norm, and a catch-up over several rows per sequence keeps only its drafting
rows after the attention block (`keep_rows`: every row's keys and values are cached by then, and
only those rows' h are read), so the MLP and the LM head run on one row per sequence; a catch-up
whose rows draft nothing (a prompt chunk) runs `cache_kv`: the layer input and the keys and values
only (layers/attention/kv_only.py), no queries, attention, o_proj, MLP or LM head. (The o
projection stays on every row: a gather before it breaks the launch chain that lets it stream its
weights during the attention, and it ran slower on the H200: docs/perf-log.md.)

Tensor parallel (options.tensor_parallel with several ranks: speculative_config
draft_tensor_parallel_size equal to the target's tensor_parallel_size; the default, 1, builds the
head whole on every rank). The layer splits like the target's: q/k/v and gate_up column-parallel
(this rank's query heads, its KV heads or the one it shares when fewer than the ranks, its MLP
columns), o_proj and down_proj row-parallel with the sum over ranks; the draft lm_head and an own
embed_tokens split by vocabulary (greedy drafts take each rank's row maxima, no gather: step's
greedy_only). fc is row-parallel: the aux hidden states are whole on every rank (after the
target's all-reduce), so each rank multiplies its own columns of them with no communication
first, and one all-reduce of [n, H] per catch-up gives g whole; each rank reads 1/N of fc's
3 * Ht * H weights (0.3 GB of bf16 for a 7168-wide target). A replicated fc would skip that one
all-reduce but read all of fc on every rank every step; a column-parallel one would need an
all-gather of g (the norms and the residual need all of it). Norms, rotary and d2t are whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from foretell.ops.common import kernel_choice
from foretell.layers.attention.layer import Attention
from foretell.layers.attention.kv_only import trailing_projection, write_rotated_kv
from foretell.layers.attention.qkv_block import attend_qkv
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.layers.embedding import VocabEmbedding
from foretell.layers.linear import QKVLinear
from foretell.layers.rank_slices import kv_head_shard
from foretell.layers.weight_loaders import make_param
from foretell.layers.parallel_linear import row_parallel_linear
from foretell.layers.norm import RMSNorm
from foretell.layers.rotary import RotaryEmbedding, rope_parameters_from_config
from foretell.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, lm_head, vocab_embedding
from foretell.models.base import (
    HFConfig, ModelOptions, WeightRule, WeightRules, check_tensor_parallel_sizes, side_by_side,
)
from foretell.models.llama import DecoderDims, DecoderMLP, DecoderSwitches

HEAD_LAYER = r"^(?:midlayer|layers\.0)\."  # the draft layer in either published format
# The CPU's table of normed embedding rows (Eagle3LayerBase.build_normed_embedding_table) up to this size:
# the default head's 4096 x 256; not a large vocabulary's copy of its embedding.
MAX_NORMED_TABLE_ELEMENTS = 1 << 22


def eagle3_weight_rules(has_embed: bool, has_lm_head: bool) -> WeightRules:
    fused = [
        WeightRule(HEAD_LAYER + r"self_attn\.q_proj\.", "midlayer.self_attn.qkv_proj.", "q"),
        WeightRule(HEAD_LAYER + r"self_attn\.k_proj\.", "midlayer.self_attn.qkv_proj.", "k"),
        WeightRule(HEAD_LAYER + r"self_attn\.v_proj\.", "midlayer.self_attn.qkv_proj.", "v"),
        WeightRule(HEAD_LAYER + r"mlp\.gate_proj\.", "midlayer.mlp.gate_up_proj.", 0),
        WeightRule(HEAD_LAYER + r"mlp\.up_proj\.", "midlayer.mlp.gate_up_proj.", 1),
        WeightRule(HEAD_LAYER, "midlayer."),
        WeightRule(r"^model\.", ""),
    ]
    ignored = [r"^t2d$", r"rotary_emb\.inv_freq$"]
    if not has_embed:
        ignored.append(r"embed_tokens\.weight$")
    if not has_lm_head:
        ignored.append(r"^lm_head\.weight$")
    return WeightRules(fused=fused, ignored=ignored)


class Eagle3Attention(nn.Module):
    def __init__(self, dims: DecoderDims, rotary: RotaryEmbedding, options: ModelOptions, bias: bool):
        super().__init__()
        kw = dict(dtype=options.dtype, device=options.device, tp=options.tensor_parallel)
        self.qkv_proj = QKVLinear(2 * dims.hidden_size, dims.head_dim, dims.num_heads, dims.num_kv_heads, bias, **kw)
        # this rank's heads (all of them with one rank); the draft KV cache holds these KV heads
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = dims.head_dim
        self.o_proj = row_parallel_linear(dims.num_heads * dims.head_dim, dims.hidden_size, bias, **kw)
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, dims.head_dim, self.num_kv_heads, dims.head_dim**-0.5, options.attention_backend)

    def forward(self, positions, x, metadata):  # x [n, 2H] -> [n, H]
        # RoPE, the KV write and attention: few torch calls on the CPU, the module path elsewhere
        return self.o_proj(attend_qkv(self.attn, self.qkv_proj(x), positions, self.rotary_emb, metadata))

    def cache_kv(self, positions, x, metadata) -> None:  # x [n, 2H]
        """forward's keys and values into the cache, the same bits (layers/attention/kv_only.py
        says where the projection's k | v rows are multiplied alone), without queries, attention or o_proj."""
        kv = trailing_projection(self.qkv_proj, x, self.qkv_proj.q_size)  # [n, 2 * KV * D]: k | v
        write_rotated_kv(self.attn, kv, positions, self.rotary_emb, metadata)


class Eagle3LayerBase(nn.Module):
    """The EAGLE3 layer's data flow, whatever its attention: a subclass builds self_attn (taking
    [n, 2H], with cache_kv(positions, x, metadata) caching its keys and values alone) and mlp, and
    calls add_norms."""

    def add_norms(self, config: HFConfig, hidden: int, eps: float, **kw) -> None:
        self.norm_before_residual = bool(config.get("norm_before_residual", False))
        self.hidden_norm = RMSNorm(hidden, eps, **kw)
        self.input_layernorm = RMSNorm(hidden, eps, **kw)
        self.post_attention_layernorm = RMSNorm(hidden, eps, **kw)

    def layer_input(
        self, input_ids: torch.Tensor, embedding: nn.Module, g: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (x [n, 2H], residual [n, H])
        """x = [input_layernorm(embedding(input_ids)) ; hidden_norm(g)], embedding first (one launch
        on CUDA: ops/pointwise/triton_eagle3_input.py; on the CPU in float32 the normed rows come from
        a table of every token's, build_normed_embedding_table), and the residual the attention's
        output is added to."""
        table = self.normed_embedding
        if (table is not None and table[0] is embedding and g.dtype == torch.float32 and not g.requires_grad
                and not kernel_choice.use_triton(input_ids, g)):
            norm = self.hidden_norm  # the same bits as the module path's, in three torch calls
            normed_g = torch.rms_norm(g, (g.shape[-1],), norm.weight, norm.eps)  # rms_norm_torch's float32 form
            x = torch.cat([F.embedding(input_ids, table[1]), normed_g], dim=-1)
            return x, normed_g if self.norm_before_residual else g
        weight = getattr(embedding, "weight", None)
        norms = (self.input_layernorm, self.hidden_norm)
        # the one-launch kernel gathers whole-vocabulary rows: not from a rank's share of them
        if (isinstance(embedding, VocabEmbedding) and not isinstance(embedding, VocabParallelEmbedding)
                and weight.dtype == g.dtype
                and all(n.weight.dtype == g.dtype for n in norms) and kernel_choice.use_triton(input_ids, weight, g)):
            from foretell.ops.pointwise.triton_eagle3_input import eagle3_input_triton  # imports triton: CUDA only

            x = eagle3_input_triton(input_ids, weight, g, self.input_layernorm.weight, self.input_layernorm.eps,
                                    self.hidden_norm.weight, self.hidden_norm.eps)
            normed_g = x[:, g.shape[1]:]
        else:
            embeds = embedding(input_ids)
            embeds, _ = self.input_layernorm(embeds if embeds.dtype == g.dtype else embeds.to(g.dtype))
            normed_g, _ = self.hidden_norm(g)
            x = torch.cat([embeds, normed_g], dim=-1)
        return x, normed_g if self.norm_before_residual else g

    #: (embedding, its rows after input_layernorm [vocab, H]) once build_normed_embedding_table ran (the CPU)
    normed_embedding: tuple[nn.Module, torch.Tensor] | None = None

    def build_normed_embedding_table(self, embedding: nn.Module) -> bool:
        """Keep input_layernorm over every row of the float32 CPU embedding [vocab, H] for layer_input
        (a row's norm does not depend on the rows beside it: the same bits as norming the rows a
        step gathers). Not for a vocabulary split over ranks or a table above
        MAX_NORMED_TABLE_ELEMENTS; the weights must not change afterwards. Returns whether it did."""
        weight, norm = getattr(embedding, "weight", None), self.input_layernorm
        if (not isinstance(embedding, VocabEmbedding) or isinstance(embedding, VocabParallelEmbedding)
                or weight.device.type != "cpu" or weight.dtype != torch.float32 or norm.weight.dtype != torch.float32
                or weight.numel() > MAX_NORMED_TABLE_ELEMENTS):
            return False
        with torch.no_grad():
            table = torch.rms_norm(weight, (weight.shape[-1],), norm.weight, norm.eps)  # [vocab, H]
        self.normed_embedding = (embedding, table)
        return True

    def cache_kv(
        self,
        positions: torch.Tensor,  # [n]
        input_ids: torch.Tensor,  # [n] token ids
        embedding: nn.Module,
        g: torch.Tensor,  # [n, H]
        metadata: AttentionMetadata,
    ) -> None:
        """What forward leaves in the draft cache, and nothing else: the layer input, then the
        attention's keys and values (no queries, attention, o_proj or MLP)."""
        x, _ = self.layer_input(input_ids, embedding, g)  # [n, 2H]
        self.self_attn.cache_kv(positions, x, metadata)

    def forward(
        self,
        positions: torch.Tensor,  # [n]
        input_ids: torch.Tensor,  # [n] token ids
        embedding: nn.Module,  # the token embedding (the head's own or the target's)
        g: torch.Tensor,  # [n, H]
        metadata: AttentionMetadata,
        keep_rows: torch.Tensor | None = None,  # [m] int64: the rows whose output is wanted; None: all
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (mlp_out, h_attn) [m, H]: h = h_attn + mlp_out
        x, residual = self.layer_input(input_ids, embedding, g)
        attn = self.self_attn(positions, x, metadata)  # every row's keys and values are cached now
        if keep_rows is not None:
            attn, residual = attn.index_select(0, keep_rows), residual.index_select(0, keep_rows)
        # h_attn = residual + attention, the add fused into the norm (one launch on CUDA)
        normed_h, h_attn = self.post_attention_layernorm(attn, residual)
        return self.mlp(normed_h), h_attn


class Eagle3Layer(Eagle3LayerBase):
    def __init__(self, dims: DecoderDims, rotary: RotaryEmbedding, options: ModelOptions, config: HFConfig):
        super().__init__()
        kw = dict(dtype=options.dtype, device=options.device)
        bias = bool(config.get("attention_bias", False))
        self.self_attn = Eagle3Attention(dims, rotary, options, bias)
        self.mlp = DecoderMLP(dims, DecoderSwitches(mlp_bias=bool(config.get("mlp_bias", False))), options)
        self.add_norms(config, dims.hidden_size, dims.rms_norm_eps, **kw)


class Eagle3Head(nn.Module):
    def __init__(
        self,
        config: HFConfig,
        target_hidden_size: int,
        target_max_positions: int,
        options: ModelOptions,
        has_embed: bool,
        has_lm_head: bool,
    ):
        super().__init__()
        kw = dict(dtype=options.dtype, device=options.device)
        tp = self.tensor_parallel = options.tensor_parallel
        hidden = config.hidden_size
        self.hidden_size = hidden
        self.vocab_size = config.vocab_size
        self.draft_vocab_size = config.get("draft_vocab_size", config.vocab_size)
        max_pos = max(config.get("max_position_embeddings", 2048), target_max_positions)
        self.check_tensor_parallel(config)
        self.rotary_emb, self.midlayer = self.build_layer(config, max_pos, options)
        fc_input = 3 * target_hidden_size
        try:  # this rank's columns of the concatenated aux states (all of them with one rank)
            self.fc_input_start, self.fc_input_part = tp.even_shard(fc_input, "fc's input width (3 x the target's hidden_size)")
        except ValueError as e:
            raise ValueError(f"{config.source}: {e}") from None
        self.fc = row_parallel_linear(fc_input, hidden, tp=tp, **kw)
        self.norm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6), **kw)
        self.embed_tokens = vocab_embedding(config.vocab_size, hidden, tp, **kw) if has_embed else None
        self.lm_head = lm_head(self.draft_vocab_size, hidden, tp, **kw) if has_lm_head else None
        self.d2t = make_param((self.draft_vocab_size,), torch.int64, options.device)
        self.d2t.dummy_value = 0
        self.weight_rules = self.build_weight_rules(has_embed, has_lm_head)
        self.shared_embed: nn.Module | None = None  # the target's, when the head has none
        self.shared_lm_head: nn.Module | None = None

    def check_tensor_parallel(self, config: HFConfig) -> None:
        """Start-up check that the layer's heads and MLP split over the ranks (errors name the
        head's config.json field)."""
        dims = DecoderDims.from_config(config)
        check_tensor_parallel_sizes(config, self.tensor_parallel, {
            "num_attention_heads": dims.num_heads, "intermediate_size": dims.intermediate_size})
        try:
            kv_head_shard(dims.num_heads, dims.num_kv_heads, self.tensor_parallel)
        except ValueError as e:
            raise ValueError(f"{config.source}: {e}") from None

    def build_layer(self, config: HFConfig, max_pos: int, options: ModelOptions) -> tuple[RotaryEmbedding, nn.Module]:
        """The rotary embedding and the draft layer (`midlayer`): a Llama layer here."""
        dims = DecoderDims.from_config(config)
        rope_theta, rope_scaling = rope_parameters_from_config(config)
        rotary = RotaryEmbedding(dims.head_dim, max_pos, rope_theta, rope_scaling, device=options.device)
        return rotary, Eagle3Layer(dims, rotary, options, config)

    def build_weight_rules(self, has_embed: bool, has_lm_head: bool) -> WeightRules:
        return eagle3_weight_rules(has_embed, has_lm_head)

    def share(self, embedding: nn.Module, lm_head: nn.Module) -> None:
        # Plain attributes set through object.__setattr__ so the target's parameters are not
        # registered (and loaded, or counted) a second time as the head's.
        object.__setattr__(self, "shared_embed", embedding)
        object.__setattr__(self, "shared_lm_head", lm_head)

    def attention_layers(self) -> list[Attention]:
        return [self.midlayer.self_attn.attn]

    def prepare_cpu_input_table(self) -> bool:
        """On the CPU, after loading and share(): the layer's table of normed embedding rows
        (Eagle3LayerBase.build_normed_embedding_table); returns whether it was built."""
        return self.midlayer.build_normed_embedding_table(self.embed_tokens or self.shared_embed)

    def combine(self, aux: list[torch.Tensor]) -> torch.Tensor:  # 3 x [n, Ht] -> [n, H]
        features = side_by_side(aux)  # [n, 3 * Ht]: no copy when the aux states share the target's buffer
        if self.tensor_parallel.is_parallel:  # this rank's columns; fc sums the products over ranks
            features = features.narrow(-1, self.fc_input_start, self.fc_input_part)
        return self.fc(features)

    def _layer(self, input_ids, positions, g, metadata, keep_rows=None):  # -> (mlp_out, h_attn) [m, H]
        return self.midlayer(positions, input_ids, self.embed_tokens or self.shared_embed, g, metadata, keep_rows)

    def forward(
        self,
        input_ids: torch.Tensor,  # [n] target token ids
        positions: torch.Tensor,  # [n]
        g: torch.Tensor,  # [n, H]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [n, H], before the final norm
        mlp_out, h_attn = self._layer(input_ids, positions, g, metadata)
        return h_attn + mlp_out

    def cache_kv(
        self,
        input_ids: torch.Tensor,  # [n] target token ids
        positions: torch.Tensor,  # [n]
        g: torch.Tensor,  # [n, H]
        metadata: AttentionMetadata,
    ) -> None:
        """forward's writes to the draft cache alone (the rows' keys and values, what a catch-up
        over rows that draft nothing needs): fc's g in, then the layer input, the K and V
        projections, RoPE on the keys and the cache write."""
        self.midlayer.cache_kv(positions, input_ids, self.embed_tokens or self.shared_embed, g, metadata)

    def step(
        self,
        input_ids: torch.Tensor,  # [n] target token ids
        positions: torch.Tensor,  # [n]
        g: torch.Tensor,  # [n, H]
        metadata: AttentionMetadata,
        keep_rows: torch.Tensor | None = None,  # [m] int64: the rows to draft from; None: all
        greedy_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (logits [m, draft_vocab] float32, h [m, H])
        """compute_logits(forward(...)[keep_rows]) and those rows of h, the last add in the final
        norm's launch and the layer past its attention on the kept rows only. With greedy_only
        (an lm_head split by vocabulary: splits_vocabulary), the rows' greedy draft ids [m] int64
        in place of the logits, gathering none."""
        mlp_out, h_attn = self._layer(input_ids, positions, g, metadata, keep_rows)
        normed, h = self.norm(mlp_out, h_attn)
        head = self.lm_head or self.shared_lm_head
        return (head.greedy_tokens(normed) if greedy_only else head(normed)), h

    @property
    def splits_vocabulary(self) -> bool:
        """Whether the lm_head in use (the head's or the target's) holds a share of the vocabulary
        per rank, so greedy drafts can skip gathering whole logits rows."""
        return isinstance(self.lm_head or self.shared_lm_head, ParallelLMHead)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:  # [n, draft_vocab] float32
        normed, _ = self.norm(h)
        return (self.lm_head or self.shared_lm_head)(normed)

    def target_ids(self) -> torch.Tensor:  # [draft_vocab] int64: target id of each draft id
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t
