"""EAGLE3 heads whose draft layer is MLA (head config with kv_lora_rank).

build_proposer maps method "eagle3" here; `from_config` returns this class for an MLA head and a
plain Eagle3Proposer for every other head, so standard heads are untouched. Everything but the
head's construction (aux layers, d2t, catch-up, chaining) is Eagle3Proposer's.
"""

from __future__ import annotations

import torch
from torch import nn

from foretell.loader import checkpoint_keys, load_weights
from foretell.models.base import HFConfig
from foretell.models.eagle3_mla import Eagle3MLAHead, is_mla_head
from foretell.spec_decode.eagle3 import Eagle3Proposer


class Eagle3MLAProposer(Eagle3Proposer):
    @classmethod
    def from_config(cls, config, target_hf_config, options) -> Eagle3Proposer:
        head_config = HFConfig.from_folder(config.model) if config.model else None
        if head_config is not None and is_mla_head(head_config):
            return cls(config, target_hf_config, options)
        return Eagle3Proposer(config, target_hf_config, options)

    def load(self, target: nn.Module, load_format: str = "auto") -> None:
        dummy = load_format == "dummy"
        keys = {} if dummy else checkpoint_keys(self.folder)
        has_embed = any(k.endswith("embed_tokens.weight") for k in keys)
        has_lm_head = dummy or "lm_head.weight" in keys
        fc_shape = keys.get("fc.weight")
        if fc_shape is not None and fc_shape[1] != 3 * self.target_hidden:
            raise ValueError(
                f"{self.folder}: fc.weight has input width {fc_shape[1]}, expected 3 x target "
                f"hidden = {3 * self.target_hidden}"
            )
        if not has_embed and self.head_config.hidden_size != target.get_input_embeddings().hidden_size:
            raise ValueError(
                f"{self.folder}: the head's hidden_size {self.head_config.hidden_size} differs from "
                f"the target's embedding width and it ships no embed_tokens.weight to use instead"
            )
        head = Eagle3MLAHead(
            self.head_config, self.target_hidden, self.target_max_positions,
            self.options, has_embed, has_lm_head,
        )
        if not has_lm_head and head.draft_vocab_size != self.target_vocab:
            raise ValueError(
                f"{self.folder} has no lm_head.weight and a draft vocabulary of "
                f"{head.draft_vocab_size} != the target's {self.target_vocab}, so it cannot share "
                f"the target's lm_head"
            )
        load_weights(head, self.folder, load_format)
        head.share(target.get_input_embeddings(), target.get_output_embeddings())
        target_ids = head.target_ids()
        outside = (target_ids < 0) | (target_ids >= self.target_vocab)
        if bool(outside.any()):
            bad = int(torch.nonzero(outside)[0])
            raise ValueError(
                f"{self.folder}: d2t maps draft id {bad} to target id {int(target_ids[bad])}, "
                f"outside the target vocabulary [0, {self.target_vocab})"
            )
        self.head = head.eval()
        self._target_ids = target_ids
