"""A small draft LM with the target's tokenizer, with its own KV cache, drafting k steps."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from foretell.device_util import to_device
from foretell.models.base import HFConfig, ModelOptions
from foretell.models.loading import build_model
from foretell.spec_decode.draft_loop import DraftLoopProposer, catch_up_rows
from foretell.spec_decode.proposer import DraftBatch


def check_same_tokenizer(target_folder: str | None, draft_folder: str, target_vocab: int, draft_vocab: int) -> None:
    """The draft must tokenize exactly as the target; compare vocabularies when both folders
    ship a tokenizer.json, else the config vocab sizes."""
    def vocab_of(folder):
        path = os.path.join(folder or "", "tokenizer.json")
        if not folder or not os.path.isfile(path):
            return None
        with open(path) as f:
            data = json.load(f)
        added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
        return data.get("model", {}).get("vocab"), added

    target, draft = vocab_of(target_folder), vocab_of(draft_folder)
    if target is not None and draft is not None:
        if target != draft:
            raise ValueError(
                f"draft model {draft_folder} does not share the target's tokenizer "
                f"({target_folder}): their tokenizer.json vocabularies differ. A draft model must "
                f"use the same tokenizer as the target"
            )
        return
    if target_vocab != draft_vocab:
        raise ValueError(
            f"draft model {draft_folder} has vocab_size {draft_vocab}, the target has "
            f"{target_vocab}: a draft model must use the same tokenizer as the target"
        )


class DraftModelProposer(DraftLoopProposer):
    method = "draft_model"
    row_offset = 0

    def __init__(self, config, target_hf_config: HFConfig, options: ModelOptions):
        super().__init__(config.num_speculative_tokens)
        self.folder = config.model
        self.hf_config = HFConfig.from_folder(config.model)
        self.options = ModelOptions(options.dtype, options.device, options.attention_backend)
        self.target_vocab = target_hf_config.vocab_size
        target_folder = os.path.dirname(target_hf_config.source) or None
        check_same_tokenizer(target_folder, config.model, self.target_vocab, self.hf_config.vocab_size)
        self.init_loop(options.device, self.target_vocab)
        self.max_positions = self.hf_config.get("max_position_embeddings", 2048)  # its rotary table's
        self.model: nn.Module | None = None

    @classmethod
    def from_config(cls, config, target_hf_config, options) -> "DraftModelProposer":
        return cls(config, target_hf_config, options)

    def load(self, target: nn.Module, load_format: str = "auto") -> None:
        self.model = build_model(self.folder, self.hf_config, self.options, load_format)

    def kv_layers(self) -> list[nn.Module]:
        return self.model.attention_layers()

    def draft_modules(self) -> list[nn.Module]:
        return [self.model]

    @property
    def draft_dtype(self) -> torch.dtype:
        return self.options.dtype

    def catch_up(self, batch: DraftBatch, last_rows: list[int]):
        input_ids, positions, metadata = catch_up_rows(batch, self.row_offset, self.draft_block_size)
        hidden, _ = self.model(input_ids, positions, metadata)
        if not last_rows:
            return None, None
        ends = to_device(metadata.query_start_loc_cpu[1:], torch.int64, self.device) - 1
        return self.model.compute_logits(hidden[ends[last_rows]]), None

    def padded_catch_up(self, input_ids, positions, metadata, hidden, aux, last_rows):
        out, _ = self.model(input_ids, positions, metadata)
        return self.model.compute_logits(out.index_select(0, last_rows)), None

    def chain_step(self, tokens, positions, metadata, state):
        hidden, _ = self.model(tokens, positions, metadata)
        return self.model.compute_logits(hidden), None
