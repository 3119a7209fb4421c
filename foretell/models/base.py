"""What every model class shares: build options, the HF config view, and the model contract.

The contract the runner relies on (it never asks which model it runs):
  model = ModelClass(hf_config, options)
  hidden, aux = model(input_ids, positions, attn_metadata)
      input_ids [num_tokens] int64, positions [num_tokens] int64
      hidden [num_tokens, hidden_size]: final hidden state AFTER the final norm
      aux: list of [num_tokens, hidden_size], the residual stream entering each layer in
           options.aux_hidden_state_layers, in that order (empty when none were asked for)
  logits = model.compute_logits(hidden)      # [n, vocab_size] float32
  model.attention_layers()                   # modules owning a KV cache, in layer order
  model.weight_rules                         # checkpoint name -> parameter rules for the loader
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from foretell.layers.attention.backend import AttentionBackend


@dataclass(frozen=True)
class ModelOptions:
    dtype: torch.dtype
    device: torch.device
    attention_backend: AttentionBackend
    aux_hidden_state_layers: tuple[int, ...] = ()


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
    (hidden, residual) whose sum is the stream; the first gets residual None.
    """
    hidden = embed_tokens(input_ids)  # [num_tokens, hidden_size]
    residual = None
    captured: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        if i in aux_layers:
            captured[i] = hidden if residual is None else residual + hidden
        hidden, residual = layer(positions, hidden, residual, metadata)
    hidden, _ = norm(hidden, residual)
    return hidden, [captured[i] for i in aux_layers]


@dataclass(frozen=True)
class WeightRule:
    """Maps checkpoint tensor names onto a (fused) parameter.

    `pattern` is a regex searched in the checkpoint name; the match is replaced by `replacement`
    to get the parameter name, and `shard` (a value, or a function of the match) is passed to the
    parameter's weight_loader to say which slice the tensor fills.
    """

    pattern: str
    replacement: str
    shard: Any | Callable[[re.Match], Any] = None

    def apply(self, name: str) -> tuple[str, Any] | None:
        match = re.search(self.pattern, name)
        if match is None:
            return None
        shard = self.shard(match) if callable(self.shard) else self.shard
        return name[: match.start()] + match.expand(self.replacement) + name[match.end() :], shard


@dataclass
class WeightRules:
    fused: list[WeightRule] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # regexes of checkpoint keys to skip
