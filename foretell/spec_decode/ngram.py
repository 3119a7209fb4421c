"""Prompt-lookup (n-gram) drafting: no model, just the sequence's own tokens.

For n from prompt_lookup_max down to prompt_lookup_min, find the most recent earlier occurrence of
the last n tokens and propose the k tokens that followed it. When the match is so recent that
fewer than k tokens follow it (a loop: the last p tokens repeat), the proposal continues the
loop: token i of the proposal is the token p places before it.
"""

from __future__ import annotations

import numpy as np

from foretell.spec_decode.proposer import DraftBatch, Proposal, ProposerBase, ProposerCapabilities


def lookup(history: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    tokens = np.asarray(history, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n :]
        # windows[i] = tokens[i : i + n], for starts that leave at least one token after them
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            period = length - start  # the tokens after the match run up to the end
            return [int(tokens[start + i % period]) for i in range(k)]
    return []


class NgramProposer(ProposerBase):
    method = "ngram"

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int):
        super().__init__(num_speculative_tokens)
        self.min_n = min_n
        self.max_n = max_n

    @property
    def capabilities(self) -> ProposerCapabilities:
        return ProposerCapabilities(deterministic=True, drafts_from_tokens=True)

    @classmethod
    def from_config(cls, config, target_hf_config, options) -> "NgramProposer":
        return cls(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, batch: DraftBatch) -> Proposal:
        # Near max_model_len only the positions below it are proposed (DraftBatch.num_useful_drafts).
        useful = [batch.num_useful_drafts(i, self.k) for i in range(batch.num_seqs)]
        drafts = [
            lookup(history, n, self.min_n, self.max_n) if n else []
            for history, n in zip(batch.histories, useful)
        ]
        return Proposal(drafts, [None] * len(drafts))
