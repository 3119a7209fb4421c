"""Suffix decoding combined with a model drafter (speculative_config {"method": "suffix",
"hybrid": "eagle3" | "mtp" | "draft_model"}).

Each step the suffix drafter drafts first; a sequence whose suffix match is at least
min_match_length tokens long takes that draft (up to num_speculative_tokens tokens), the others
the model drafter's (its own k, at most as many). The model drafter still catches up on every
sequence's accepted rows (its KV cache must hold every token), but drafts only for the sequences
that need it: it gets them as the ones that sampled.

Suffix drafts carry no probabilities (one-hot, exact under rejection sampling); the model's
keep theirs. The hybrid drafts on the host (no padded device loop), like the suffix drafter: its
verifies take the padded step, and after each step's read the model drafter catches up over that
step's target rows (runner/host_drafts.py's DrafterRows).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from foretell.spec_decode.proposer import (
    DraftBatch, PaddedDrafter, Proposal, Proposer, ProposerCapabilities,
)
from foretell.spec_decode.suffix import SuffixProposer


class HybridProposer:
    method = "suffix"

    def __init__(self, suffix: SuffixProposer, model: Proposer, min_match_length: int):
        self.suffix = suffix
        self.model = model
        self.min_match_length = min_match_length
        self.k = max(suffix.k, model.k)
        self.num_suffix_drafts = 0  # sequences drafted by each side, for benchmarks
        self.num_model_drafts = 0

    @property
    def capabilities(self) -> ProposerCapabilities:
        return replace(self.model.capabilities, deterministic=False, catch_up_skippable=False)  # proposes every step

    def load(self, target: nn.Module, load_format: str = "auto") -> None:
        self.model.load(target, load_format)

    def kv_layers(self) -> list[nn.Module]:
        return self.model.kv_layers()

    def draft_modules(self) -> list[nn.Module]:
        return self.model.draft_modules()

    @property
    def draft_dtype(self) -> torch.dtype | None:
        return self.model.draft_dtype

    def bind_draft_cache(self, block_size: int) -> None:
        self.model.bind_draft_cache(block_size)

    @property
    def cpu_direct_step(self) -> bool:
        """The model drafter's flag (an EAGLE3 head's step in direct torch calls on the CPU, which
        the runner's CPU set-up turns on: runner/cpu_setup.py)."""
        return bool(getattr(self.model, "cpu_direct_step", False))

    @cpu_direct_step.setter
    def cpu_direct_step(self, on: bool) -> None:
        self.model.cpu_direct_step = on

    def padded_drafter(self) -> PaddedDrafter | None:
        return None  # the suffix side drafts on the host every step

    def forget(self, seq_id: int) -> None:
        self.suffix.forget(seq_id)
        self.model.forget(seq_id)

    def drop_cached_responses(self) -> None:
        self.suffix.drop_cached_responses()
        self.model.drop_cached_responses()

    def stats(self) -> dict:
        return {**self.model.stats(), **self.suffix.stats()}

    def propose(self, batch: DraftBatch) -> Proposal:
        drafts = self.suffix.propose_drafts(batch)
        use_suffix = [
            bool(d.token_ids) and d.match_length >= self.min_match_length for d in drafts
        ]
        model_samples = [s and not u for s, u in zip(batch.samples, use_suffix)]
        model_batch = batch if model_samples == batch.samples else replace(batch, samples=model_samples)
        proposal = self.model.propose(model_batch)
        tokens, probs = list(proposal.token_ids), list(proposal.probs)
        for i, chosen in enumerate(use_suffix):
            if chosen and batch.samples[i]:
                tokens[i], probs[i] = drafts[i].token_ids, None
                self.num_suffix_drafts += 1
            elif batch.samples[i]:
                self.num_model_drafts += 1
        return Proposal(tokens, probs)
