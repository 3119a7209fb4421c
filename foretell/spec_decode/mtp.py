"""MTP drafting ("method": "mtp"): the target's own next-token layers propose k tokens.

Weights come from the target's folder (or speculative_config["model"] when given), keys
`model.layers.{N+i}.*` (foretell/models/mtp.py); the target's embedding is shared.

Rows follow the EAGLE convention of DraftLoopProposer: the row at position t pairs a hidden state
for t with the token x_{t+1}. The catch-up runs MTP layer 0 over the rows whose target outputs
became final, fed the target's final hidden states (after its last norm), so its cache is right
for every accepted token; its last row gives draft 1. Draft j + 1 (j >= 1) comes from MTP layer
j mod num_layers, fed the previous step's output and the previous draft.

Cost of k > num_nextn_predict_layers: DeepSeek-V3/R1 ship one MTP layer, trained to predict one
token further than the target from the target's own hidden state. Drafts 2..k reuse it on its
own output, a state it never saw in training, so acceptance falls with depth (the target checks
every draft, so outputs stay exact). Published measurements put DeepSeek-V3's draft-1 acceptance
at 85-90%; expect each further reused step to be accepted noticeably less often, and measure with
`foretell bench` before raising k past 2-3.

With several MTP layers (num_nextn_predict_layers > 1), layer i >= 1 also catches up over the
same rows, so its cache covers every accepted token: its row at position t takes layer i-1's
output at t-1 and the token x_{t+1}, as in the chain. The first row of a sequence's step has no
t-1 output in the step and takes the one at t (an approximation of that one cache entry; drafts
get a little worse, outputs stay exact).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from foretell.models.loading import load_model_weights
from foretell.models.base import HFConfig, ModelOptions
from foretell.models.mtp import DeepseekMTP
from foretell.spec_decode.draft_loop import DraftLoopProposer, catch_up_rows
from foretell.spec_decode.proposer import DraftBatch

# Architectures whose MTP layers DeepseekMTP builds: (key prefix, default scoring, topk method).
MTP_ARCHITECTURES = {
    "DeepseekV3ForCausalLM": ("", ("sigmoid", "noaux_tc")),
    "DeepseekV2ForCausalLM": ("", ("softmax", "greedy")),
    "KimiK25ForConditionalGeneration": ("language_model.", ("sigmoid", "noaux_tc")),
}


class MTPProposer(DraftLoopProposer):
    method = "mtp"
    row_offset = -1

    def __init__(self, config, target_hf_config: HFConfig, options: ModelOptions):
        super().__init__(config.num_speculative_tokens)
        archs = target_hf_config.get("architectures") or []
        known = [a for a in archs if a in MTP_ARCHITECTURES]
        if not known:
            raise ValueError(
                f"{target_hf_config.source}: speculative method 'mtp' drafts with DeepSeek-style "
                f"MTP layers; architectures {archs} are not one of {sorted(MTP_ARCHITECTURES)}"
            )
        self.prefix, self.default_router = MTP_ARCHITECTURES[known[0]]
        self.text_config = (
            target_hf_config.sub("text_config") if "text_config" in target_hf_config else target_hf_config
        )
        if not self.text_config.get("num_nextn_predict_layers", 0):
            raise ValueError(
                f"{self.text_config.source}: num_nextn_predict_layers is 0 or absent, so this "
                f"model has no MTP layers to draft with; use method eagle3, draft_model or ngram"
            )
        self.folder = config.model or os.path.dirname(target_hf_config.source.split(":")[0])
        # Under the target's tensor and expert parallelism (its layers split as the target's are).
        self.options = ModelOptions(options.dtype, options.device, options.attention_backend,
                                    tensor_parallel=options.tensor_parallel, expert_parallel=options.expert_parallel,
                                    quantization=options.quantization)
        self.init_loop(options.device, self.text_config.vocab_size)
        # The head splits the vocabulary like the target's lm_head: greedy drafts need no gather.
        self.greedy_without_logits = options.tensor_parallel.is_parallel
        self.mtp: DeepseekMTP | None = None

    @classmethod
    def from_config(cls, config, target_hf_config, options) -> "MTPProposer":
        return cls(config, target_hf_config, options)

    def load(self, target: nn.Module, load_format: str = "auto") -> None:
        # Layers take dtype and device from the options: parameters are created where they live.
        mtp = DeepseekMTP(self.text_config, self.options, self.prefix, self.default_router)
        load_model_weights(mtp, self.folder, self.options, load_format)  # (and quantization="fp8")
        mtp.share_embedding(target.get_input_embeddings())
        self.mtp = mtp.eval()

    def kv_layers(self) -> list[nn.Module]:
        return self.mtp.attention_layers()

    def draft_modules(self) -> list[nn.Module]:
        return [self.mtp]

    @property
    def draft_dtype(self) -> torch.dtype:
        return self.options.dtype

    def catch_up(self, batch: DraftBatch, last_rows: list[int], greedy_only: bool = False):
        input_ids, positions, metadata = catch_up_rows(batch, self.row_offset, self.draft_block_size)
        out = self.mtp.step(0, positions, input_ids, batch.hidden_states, metadata)  # [rows, H]
        previous = out
        for layer in range(1, self.mtp.num_layers):
            previous = self._catch_up_layer(layer, previous, input_ids, positions, metadata)
        if not last_rows:
            return None, None
        ends = torch.tensor(metadata.query_start_loc_cpu[1:], device=self.device) - 1
        state = out[ends[last_rows]]
        return self._head(0, state, greedy_only), (state, 1)

    def padded_catch_up(self, input_ids, positions, metadata, hidden, aux, last_rows, greedy_only: bool = False):
        out = self.mtp.step(0, positions, input_ids, hidden, metadata)  # [rows, H]
        previous = out
        rows = torch.arange(out.shape[0], device=self.device)
        # Every sequence has max_query_len rows here: the same shift as _catch_up_layer's,
        # computed on the device (capturable).
        pred = rows - (rows % metadata.max_query_len != 0).to(torch.int64)
        for layer in range(1, self.mtp.num_layers):
            previous = self.mtp.step(layer, positions, input_ids, previous[pred], metadata)
        state = out.index_select(0, last_rows)
        return self._head(0, state, greedy_only), (state, 1)

    def _catch_up_layer(self, layer, previous, input_ids, positions, metadata):
        """Layer `layer` over all catch-up rows: the row at t gets layer - 1's output at t - 1;
        the first row of each sequence, whose t - 1 ran in an earlier step, gets the output at
        t instead (an approximation that only shifts that one cache entry)."""
        starts = metadata.query_start_loc_cpu
        pred = torch.arange(previous.shape[0], device=self.device) - 1
        pred[torch.tensor(starts[:-1], device=self.device)] += 1
        return self.mtp.step(layer, positions, input_ids, previous[pred], metadata)

    def chain_step(self, tokens, positions, metadata, state, greedy_only: bool = False):
        h, step = state
        layer = step % self.mtp.num_layers
        out = self.mtp.step(layer, positions, tokens, h, metadata)
        return self._head(layer, out, greedy_only), (out, step + 1)

    def _head(self, layer: int, out: torch.Tensor, greedy_only: bool) -> torch.Tensor:
        """Logits [n, vocab] float32 of MTP layer `layer`'s output rows, or with greedy_only
        (greedy_without_logits) their greedy tokens [n] int64, gathering no logits."""
        if greedy_only:
            return self.mtp.compute_greedy_tokens(layer, out)
        return self.mtp.compute_logits(layer, out)
