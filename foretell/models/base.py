"""What every model class shares: build options, the HF config view, and the model contract.

The contract the runner relies on (it never asks which model it runs):
  model = ModelClass(hf_config, options)
  hidden, aux = model(input_ids, positions, attn_metadata)
      input_ids [num_tokens] int64, positions [num_tokens] int64
      hidden [num_tokens, hidden_size]: final hidden state AFTER the final norm
      aux: list of [num_tokens, hidden_size], the residual stream entering each layer in
           options.aux_hidden_state_layers, in that order (empty when none were asked for)
  logits = model.compute_logits(hidden)      # [n, vocab_size] float32 (whole rows on every rank)
  tokens = model.compute_greedy_tokens(hidden)  # [n] int64: argmax of those rows, ties to the
                                             # lowest id (under tensor parallelism without a gather)
  model.attention_layers()                   # modules owning a KV cache, in layer order
  model.weight_rules                         # checkpoint name -> parameter rules for the loader

Under tensor parallelism (options.tensor_parallel with several ranks) every rank builds the same
model holding its slices of the weights; hidden states and logits come out whole on every rank.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from foretell.distributed.tensor_parallel import TensorParallel
from foretell.layers.quantization import QuantizedWeights
from foretell.ops.attention.dispatch import AttentionBackend
from foretell.weight_rules import WeightRule, WeightRules  # noqa: F401 (models import them from here)


@dataclass(frozen=True)
class ModelOptions:
    dtype: torch.dtype
    device: torch.device
    attention_backend: AttentionBackend
    aux_hidden_state_layers: tuple[int, ...] = ()
    # This rank's place in the tensor-parallel group; the default is one rank (nothing split).
    tensor_parallel: TensorParallel = field(default_factory=TensorParallel)
    # MoE layers partition their routed experts over the ranks instead of splitting each expert
    # (ParallelConfig.enable_expert_parallel); no effect with one rank or a dense model.
    expert_parallel: bool = False
    # Low-precision weights (models/quantization.py decides from the checkpoint's
    # quantization_config and ModelConfig.quantization); None: every weight in `dtype`.
    quantization: QuantizedWeights | None = None

    @property
    def fp8_block(self) -> tuple[int, int] | None:
        """The block of the FP8 linears and experts built as the checkpoint ships them, or None."""
        return None if self.quantization is None else self.quantization.fp8_block

    @property
    def int4_group(self) -> int | None:
        """The group size of int4 routed experts (compressed-tensors), or None."""
        return None if self.quantization is None else self.quantization.int4_group


def check_tensor_parallel_sizes(config: "HFConfig", tp: TensorParallel, sizes: dict[str, int]) -> None:
    """Start-up check that tensor_parallel_size divides every config size the model splits evenly
    (field name -> value); one error naming the config file and every field that does not."""
    if not tp.is_parallel:
        return
    bad = [f"{name} = {value}" for name, value in sizes.items() if value % tp.world_size]
    if bad:
        raise ValueError(
            f"{config.source}: tensor_parallel_size = {tp.world_size} does not divide "
            f"{', '.join(bad)}; choose a tensor_parallel_size that divides "
            f"{'it' if len(bad) == 1 else 'them'}"
        )


class HFConfig:
    """Attribute view over a config.json dict; missing keys raise with the file named.

    We read config.json ourselves rather than through transformers' config classes so that the
    engine behaves the same across transformers versions (they moved rope fields between 4.x
    and 5.x).
    """

    def __init__(self, data: dict[str, Any], source: str = "config.json"):
        self._data = data
        self._source = source

    @classmethod
    def from_folder(cls, folder: str) -> "HFConfig":
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} not found: a model folder must hold a Hugging Face config.json"
            )
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        return cls(data, path)

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):
            raise AttributeError(key)
        if key not in self._data:
            raise KeyError(f"{self._source} has no field {key!r}, which this model needs")
        return self._data[key]

    def get(self, key: str, default: Any = None) -> Any:
        value = self._data.get(key, default)
        return default if value is None else value

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def to_dict(self) -> dict[str, Any]:
        return dict(self._data)

    def language_model(self) -> "HFConfig":
        """The language model's config: text_config for multimodal layouts (Kimi-K2.5), else
        this one. Vocabulary, layers, hidden size and positions are read from it."""
        return self.sub("text_config") if "text_config" in self._data else self

    def sub(self, key: str) -> "HFConfig":
        """A nested config (e.g. Kimi-K2.5's text_config)."""
        return HFConfig(self._data[key], f"{self._source}:{key}")

    @property
    def source(self) -> str:
        return self._source


class PreNormDecoderLayer(torch.nn.Module):
    """A decoder layer as run_decoder_stack drives it: norm -> self_attn -> norm -> mlp, the
    residual add fused into each norm. Subclasses build input_layernorm, self_attn,
    post_attention_layernorm and mlp (the checkpoint's names)."""

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]; None entering the first layer
        metadata,
        stream_out: torch.Tensor | None = None,  # [num_tokens, hidden_size]: gets the stream entering it
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual), whose sum is the stream after the layer; with stream_out (and a
        residual) the input norm's launch also writes the stream entering the layer there."""
        hidden, residual = self.input_layernorm(hidden, residual, residual_out=stream_out)
        hidden = self.self_attn(positions, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def run_decoder_stack(
    embed_tokens: "torch.nn.Module",
    layers: "torch.nn.ModuleList",
    norm: "torch.nn.Module",
    input_ids: torch.Tensor,  # [num_tokens]
    positions: torch.Tensor,  # [num_tokens]
    metadata,
    aux_layers: tuple[int, ...] = (),
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Embeddings -> pre-norm layers (residual add fused into the next norm) -> final norm.

    Returns the hidden states after the final norm [num_tokens, hidden] and the residual stream
    entering each layer in aux_layers (HF's hidden_states[i]). Every layer takes and returns
    (hidden, residual) whose sum is the stream; the first gets residual None. The aux states are
    column blocks of one [num_tokens, len(aux_layers) * hidden] buffer, in aux_layers' order, each
    written by its layer's input norm (no add of its own), so EAGLE3's fc reads them without a
    concatenation (side_by_side).
    """
    hidden = embed_tokens(input_ids)  # [num_tokens, hidden_size]
    residual = None
    column = {layer: j for j, layer in reversed(list(enumerate(aux_layers)))}  # a layer named twice: its first
    streams = hidden.new_empty(hidden.shape[0], len(aux_layers), hidden.shape[1])  # [num_tokens, aux, hidden]
    for i, layer in enumerate(layers):
        stream_out = streams[:, column[i]] if i in column else None
        if stream_out is not None and residual is None:  # the first layer: the stream is the embedding
            stream_out.copy_(hidden)
        hidden, residual = layer(positions, hidden, residual, metadata, stream_out=stream_out)
    hidden, _ = norm(hidden, residual)
    return hidden, [streams[:, column[i]] for i in aux_layers]


def side_by_side(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts, dim=-1) for [n, w_i] tensors, without a copy when they already sit side by
    side in one buffer (run_decoder_stack's aux states, or rows sliced from them)."""
    first = parts[0]
    width = sum(p.shape[-1] for p in parts)
    offset = first.storage_offset()
    for p in parts:
        if (p.dim() != 2 or p.shape[0] != first.shape[0] or p.stride() != (width, 1) or p.storage_offset() != offset
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return torch.cat(parts, dim=-1)
        offset += p.shape[1]
    return first.as_strided((first.shape[0], width), (width, 1))


class CausalLM(torch.nn.Module):
    """The part of the contract every decoder-only target shares: `self.model` is its decoder
    stack (embed_tokens, layers[i].self_attn.attn, called with the aux layers) and `self.lm_head`
    its output head, tied to the embedding when the config says so. A subclass builds
    `self.model`, then calls attach_lm_head."""

    # Whether the class splits its layers over tensor-parallel ranks (a constant per class).
    supports_tensor_parallel = False

    def __init__(self, config: HFConfig, options: ModelOptions):
        super().__init__()
        if options.tensor_parallel.is_parallel and not self.supports_tensor_parallel:
            raise ValueError(
                f"{type(self).__name__} ({config.source}) does not run tensor-parallel yet; use "
                f"tensor_parallel_size=1 (the Llama family, Mistral, Qwen2, Qwen3, DeepSeek-V2/V3 and Kimi-K2 do)"
            )
        self.config = config
        self.options = options
        num_layers = config.num_hidden_layers
        bad = [i for i in options.aux_hidden_state_layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(
                f"aux_hidden_state_layers {list(options.aux_hidden_state_layers)} must be layer "
                f"indices in [0, {num_layers}) for {config.source} (num_hidden_layers="
                f"{num_layers}); {bad} are not"
            )
        self.aux_hidden_state_layers = tuple(options.aux_hidden_state_layers)

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    def attach_lm_head(self, hidden_size: int) -> None:
        from foretell.layers.vocab_parallel import lm_head

        self.lm_head = lm_head(
            self.config.vocab_size, hidden_size, self.options.tensor_parallel,
            tie_to=self.model.embed_tokens if self.tie_word_embeddings else None,
            dtype=self.options.dtype, device=self.options.device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn_metadata,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # hidden [num_tokens, hidden_size] after the final norm; aux: list of the same shape
        return self.model(input_ids, positions, attn_metadata, self.aux_hidden_state_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        return self.lm_head(hidden)

    @property
    def splits_vocabulary(self) -> bool:
        """Whether each tensor-parallel rank holds a share of the vocabulary: compute_logits then
        gathers whole rows, compute_greedy_tokens does not."""
        return self.options.tensor_parallel.is_parallel

    def compute_greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n] int64
        """The greedy tokens of compute_logits' rows; with the vocabulary split over ranks, without
        gathering the logits (ParallelLMHead.greedy_tokens)."""
        if self.splits_vocabulary:
            return self.lm_head.greedy_tokens(hidden)
        return self.lm_head(hidden).argmax(dim=-1)

    def attention_layers(self) -> list[torch.nn.Module]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head
