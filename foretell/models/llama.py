"""The Llama family of dense decoders: Llama (2, 3, 3.1), Mistral, Qwen2 and Qwen3.

One decoder-layer class serves them all; the members differ only by a few switches read from the
config (`DecoderSwitches`): biases on the q/k/v and o projections, MLP bias, and Qwen3's per-head
RMSNorm of q and k (over head_dim, before RoPE).

Module and parameter names mirror the Hugging Face checkpoints. Two fused parameters pack several
checkpoint tensors (see `family_weight_rules`):
  model.layers.N.self_attn.qkv_proj  <- q_proj, k_proj, v_proj   (shards "q", "k", "v")
  model.layers.N.mlp.gate_up_proj     <- gate_proj, up_proj        (shards 0, 1)
With tied embeddings, lm_head uses model.embed_tokens.weight and a checkpoint's lm_head.weight,
if present, is ignored.

Tensor parallel (options.tensor_parallel): q/k/v and gate_up column-parallel (this rank's query
heads, KV heads split or replicated when fewer than the ranks, and its share of the MLP), o_proj
and down_proj row-parallel with the sum over ranks, embedding and lm_head split by vocabulary.
num_attention_heads and intermediate_size must be divisible by tensor_parallel_size, checked at
construction with the config file named.

Sliding-window attention (Mistral v0.1, Qwen2 with use_sliding_window) is not implemented: such
models are exact only while contexts stay within the window, and we warn at construction.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from foretell.layers.attention.kv_scales import kv_scale_rules
from foretell.layers.attention.layer import Attention
from foretell.layers.attention.qkv_block import ForwardRows, attend_qkv
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.layers.linear import MergedLinear, QKVLinear
from foretell.layers.rank_slices import kv_head_shard
from foretell.layers.parallel_linear import row_parallel_linear
from foretell.layers.norm import RMSNorm, rms_norm_torch
from foretell.layers.rotary import RotaryEmbedding, rope_parameters_from_config
from foretell.layers.vocab_parallel import vocab_embedding
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


@dataclass(frozen=True)
class DecoderSwitches:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


@dataclass(frozen=True)
class DecoderDims:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float

    @classmethod
    def from_config(cls, config: HFConfig) -> "DecoderDims":
        num_heads = config.num_attention_heads
        head_dim = config.get("head_dim") or config.hidden_size // num_heads
        return cls(
            hidden_size=config.hidden_size,
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        )


def family_weight_rules(tie_word_embeddings: bool) -> WeightRules:
    fused = [
        *kv_scale_rules(r"\.self_attn\.", ".self_attn.attn.kv_scales."),  # FP8 KV cache scales, when calibrated
        WeightRule(r"\.q_proj\.", ".qkv_proj.", "q"),
        WeightRule(r"\.k_proj\.", ".qkv_proj.", "k"),
        WeightRule(r"\.v_proj\.", ".qkv_proj.", "v"),
        WeightRule(r"\.gate_proj\.", ".gate_up_proj.", 0),
        WeightRule(r"\.up_proj\.", ".gate_up_proj.", 1),
    ]
    # Older checkpoints saved the rotary buffer; we recompute it from the config.
    ignored = [r"rotary_emb\.inv_freq$"]
    if tie_word_embeddings:
        ignored.append(r"^lm_head\.weight$")
    return WeightRules(fused=fused, ignored=ignored)


class DecoderAttention(nn.Module):
    def __init__(
        self,
        dims: DecoderDims,
        switches: DecoderSwitches,
        rotary_emb: RotaryEmbedding,
        options: ModelOptions,
    ):
        super().__init__()
        kw = dict(dtype=options.dtype, device=options.device, fp8_block=options.fp8_block)
        tp = options.tensor_parallel
        self.qkv_proj = QKVLinear(
            dims.hidden_size, dims.head_dim, dims.num_heads, dims.num_kv_heads,
            bias=switches.qkv_bias, tp=tp, **kw,
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = dims.head_dim
        self.o_proj = row_parallel_linear(
            dims.num_heads * dims.head_dim, dims.hidden_size, bias=switches.o_bias, tp=tp, **kw
        )
        if switches.qk_norm:
            norm_kw = dict(dtype=options.dtype, device=options.device)
            self.q_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps, **norm_kw)
            self.k_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps, **norm_kw)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb  # shared by all layers
        self.attn = Attention(
            self.num_heads, dims.head_dim, self.num_kv_heads, dims.head_dim**-0.5,
            options.attention_backend,
        )

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        metadata: AttentionMetadata,
        shared: ForwardRows | None = None,  # what every layer's block shares, gathered once (torch path)
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        qk_norm = (self.q_norm, self.k_norm) if self.q_norm is not None else None  # Qwen3
        out = attend_qkv(self.attn, self.qkv_proj(hidden), positions, self.rotary_emb, metadata, qk_norm, shared)
        return self.o_proj(out)  # out [T, heads * head_dim]


class DecoderMLP(nn.Module):
    def __init__(self, dims: DecoderDims, switches: DecoderSwitches, options: ModelOptions):
        super().__init__()
        kw = dict(dtype=options.dtype, device=options.device, fp8_block=options.fp8_block)
        size, tp = dims.intermediate_size, options.tensor_parallel
        self.gate_up_proj = MergedLinear(dims.hidden_size, [size, size], switches.mlp_bias, tp=tp, **kw)
        self.down_proj = row_parallel_linear(size, dims.hidden_size, switches.mlp_bias, tp=tp, **kw)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        return self.down_proj(self.gate_up_proj.forward_gated(hidden))  # silu(gate) * up: gate_up's epilogue


class DecoderLayer(PreNormDecoderLayer):
    """Pre-norm attention + MLP block; the residual add is fused into the next norm.

    Takes and returns (hidden, residual) whose sum is the residual stream; the first layer gets
    residual None and the stream in `hidden`.
    """

    def __init__(
        self,
        dims: DecoderDims,
        switches: DecoderSwitches,
        rotary_emb: RotaryEmbedding,
        options: ModelOptions,
    ):
        super().__init__()
        kw = dict(dtype=options.dtype, device=options.device)
        self.self_attn = DecoderAttention(dims, switches, rotary_emb, options)
        self.mlp = DecoderMLP(dims, switches, options)
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, **kw)

    def forward_torch(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]; None entering the first layer
        metadata: AttentionMetadata,
        shared: ForwardRows | None,
        stream_out: torch.Tensor | None = None,  # [num_tokens, hidden_size]: gets the stream entering it
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's arithmetic on the torch path (the CPU) in fewer calls: the residual adds and the
        norms inline (RMSNorm's torch form; no kernel to choose), what the layers share given."""
        if residual is None:
            residual = hidden
        elif stream_out is not None:
            residual = torch.add(residual, hidden, out=stream_out)
        else:
            residual = residual + hidden
        norm = self.input_layernorm
        hidden = self.self_attn(positions, rms_norm_torch(residual, norm.weight, norm.eps), metadata, shared)
        residual = residual + hidden
        norm = self.post_attention_layernorm
        return self.mlp(rms_norm_torch(residual, norm.weight, norm.eps)), residual


class DecoderModel(nn.Module):
    """The `model.` prefix of the checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: HFConfig, switches: DecoderSwitches, options: ModelOptions):
        super().__init__()
        kw = dict(dtype=options.dtype, device=options.device)
        dims = DecoderDims.from_config(config)
        self.dims = dims
        check_tensor_parallel_dims(config, dims, options)
        rope_theta, rope_scaling = rope_parameters_from_config(config)
        rotary_dim = int(dims.head_dim * config.get("partial_rotary_factor", 1.0))
        self.rotary_emb = RotaryEmbedding(
            rotary_dim, config.max_position_embeddings, rope_theta, rope_scaling,
            device=options.device,
        )
        self.embed_tokens = vocab_embedding(config.vocab_size, dims.hidden_size, options.tensor_parallel, **kw)
        self.layers = nn.ModuleList(
            DecoderLayer(dims, switches, self.rotary_emb, options)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, **kw)
        # The CPU forward when the runner installs a compiled one (runner/cpu_compile.py); None: forward_torch
        self.cpu_forward: Callable | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        metadata: AttentionMetadata,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if input_ids.is_cuda:
            return run_decoder_stack(
                self.embed_tokens, self.layers, self.norm, input_ids, positions, metadata, aux_layers
            )
        if self.cpu_forward is not None:
            return self.cpu_forward(input_ids, positions, metadata, aux_layers)
        return self.forward_torch(input_ids, positions, metadata, aux_layers)

    def forward_torch(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        metadata: AttentionMetadata,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """run_decoder_stack's arithmetic, bit for bit, in fewer torch calls (a small model's CPU step
        is mostly per-call overhead, issue 32): the layers' forward_torch, and what their attention
        blocks share (the RoPE rows of `positions`, a one-sequence step's context blocks) gathered once."""
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        shared = ForwardRows.gather(self.rotary_emb, positions, metadata, self.dims.head_dim, hidden.dtype)
        column = {layer: j for j, layer in reversed(list(enumerate(aux_layers)))}  # a layer named twice: its first
        streams = hidden.new_empty(hidden.shape[0], len(aux_layers), hidden.shape[1])  # [num_tokens, aux, hidden]
        residual = None
        for i, layer in enumerate(self.layers):
            stream_out = streams[:, column[i]] if i in column else None
            if stream_out is not None and residual is None:  # the first layer: the stream is the embedding
                stream_out.copy_(hidden)
            hidden, residual = layer.forward_torch(positions, hidden, residual, metadata, shared, stream_out)
        hidden = rms_norm_torch(residual + hidden, self.norm.weight, self.norm.eps)
        return hidden, [streams[:, column[i]] for i in aux_layers]


class LlamaForCausalLM(CausalLM):
    """Also the class for every family member; subclasses only choose `switches`."""

    supports_tensor_parallel = True

    @classmethod
    def switches(cls, config: HFConfig) -> DecoderSwitches:
        bias = bool(config.get("attention_bias", False))
        return DecoderSwitches(
            qkv_bias=bias, o_bias=bias, mlp_bias=bool(config.get("mlp_bias", False))
        )

    def __init__(self, config: HFConfig, options: ModelOptions):
        super().__init__(config, options)
        _warn_sliding_window(config)
        self.model = DecoderModel(config, self.switches(config), options)
        self.attach_lm_head(self.model.dims.hidden_size)
        self.weight_rules = family_weight_rules(self.tie_word_embeddings)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def switches(cls, config: HFConfig) -> DecoderSwitches:
        # Qwen2 always has q/k/v biases and never an o_proj bias; its config has no field for it.
        return DecoderSwitches(qkv_bias=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def switches(cls, config: HFConfig) -> DecoderSwitches:
        bias = bool(config.get("attention_bias", False))
        return DecoderSwitches(qkv_bias=bias, o_bias=bias, qk_norm=True)


def check_tensor_parallel_dims(config: HFConfig, dims: DecoderDims, options: ModelOptions) -> None:
    """The sizes split over ranks divide by tensor_parallel_size (errors name config.json's fields)."""
    tp = options.tensor_parallel
    check_tensor_parallel_sizes(config, tp, {"num_attention_heads": dims.num_heads,
                                             "intermediate_size": dims.intermediate_size})
    try:
        kv_head_shard(dims.num_heads, dims.num_kv_heads, tp)
    except ValueError as e:
        raise ValueError(f"{config.source}: {e}") from None


def _warn_sliding_window(config: HFConfig) -> None:
    window = config.get("sliding_window")
    if "use_sliding_window" in config:
        uses_window = bool(config.get("use_sliding_window", False))
    else:
        uses_window = window is not None
    if window is not None and uses_window and window < config.max_position_embeddings:
        warnings.warn(
            f"{config.source}: sliding_window={window} is not implemented; attention is full, "
            f"so outputs are exact only for contexts up to {window} tokens",
            stacklevel=3,
        )
