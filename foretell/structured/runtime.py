"""StructuredOutputs: the runner's side of structured outputs (runner/host_step.py holds one).

Per sequence with SamplingParams.structured_outputs it keeps a SequenceMatcher (matcher.py),
created at the sequence's first sampling step and brought up to its output tokens at every step
(after a preemption, forget() drops it and the next step replays the output into a new one).

mask_logits(): before the sampler or the verifier, every sampling row of such a sequence gets its
grammar's mask as -inf on the logits (bitmask.py; one host-to-device copy per step), row j of a
verify as if drafts d_0..d_{j-1} had been accepted. Greedy verification then accepts a draft only
where the masked target picks it, and rejection sampling runs against the masked distribution, so
the output is exactly what plain masked decoding gives, under every drafter.

truncate_drafts(): a proposer's next drafts are cut at the first one the grammar rejects, so the
verify spends no rows on drafts that cannot be accepted. Only where that is exact: greedy requests,
and sampled requests whose drafts carry no distribution (deterministic drafts, such as n-gram's).
A sampled draft from a distribution q must stay (rejection sampling at a draft the mask forbids
draws from the residual max(0, p - q), which keeps the target's distribution; dropping it would not).

The tokenizer (the runner's own copy, for llguidance's token table) is loaded when a request
first asks for structured outputs.
"""

from __future__ import annotations

import numpy as np
import torch

from foretell.engine.errors import SequenceError
from foretell.structured.bitmask import apply_token_bitmask, num_mask_words
from foretell.structured.matcher import GrammarViolation, SequenceMatcher


class StructuredOutputs:
    def __init__(self, tokenizer_source: str | None, vocab_size: int):
        self.tokenizer_source = tokenizer_source  # a folder or Hub id (foretell.tokenizer.Tokenizer)
        self.vocab_size = vocab_size  # the target's logits width
        self.matchers: dict[int, SequenceMatcher] = {}  # seq_id ->
        self._ll_tokenizer = None
        self.num_words = num_mask_words(vocab_size)

    # ---- matchers ------------------------------------------------------------------------
    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance.hf

            from foretell.tokenizer import Tokenizer

            if self.tokenizer_source is None:
                raise ValueError("structured outputs need the model's tokenizer, and this runner has none")
            hf = Tokenizer(self.tokenizer_source).hf
            n_vocab = max(self.vocab_size, len(hf))
            self.num_words = num_mask_words(n_vocab)
            self._ll_tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab)
        return self._ll_tokenizer

    def matcher_for(self, seq) -> SequenceMatcher:
        """The sequence's matcher, advanced through its output tokens so far."""
        matcher = self.matchers.get(seq.seq_id)
        try:
            if matcher is None:
                import llguidance

                tokenizer = self._tokenizer()
                params = seq.sampling_params.structured_outputs
                eos = [t for t in seq.eos_token_ids if t < self.num_words * 32]
                matcher = SequenceMatcher(llguidance.LLMatcher(tokenizer, params.compiled), eos,
                                          tokenizer.eos_token, self.num_words)
                self.matchers[seq.seq_id] = matcher
            matcher.advance(seq.output_token_ids)
        except GrammarViolation as e:
            raise SequenceError(seq.seq_id, f"structured outputs of request {seq.request_id!r}: {e}") from e
        return matcher

    def forget(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)

    # ---- the step ------------------------------------------------------------------------
    @staticmethod
    def any_structured(items: list) -> bool:
        return any(item.seq.sampling_params.structured_outputs is not None for item in items)

    def mask_logits(
        self,
        logits: torch.Tensor,  # [sampling rows, vocab] float32: 1 + k rows per sampling sequence, in order
        items: list,  # ScheduledSequence of each sampling sequence, in row order
        copy: bool,  # mask a copy (the caller still reads `logits` unmasked)
        fallback: torch.Tensor | None = None,  # [sampling rows, vocab]: before other controls
    ) -> torch.Tensor:
        """The logits with every structured row's grammar mask applied (`logits` itself when no
        sequence of the step has structured outputs). A row the other controls leave with no
        allowed token takes `fallback`'s logits under the mask (bitmask.apply_token_bitmask)."""
        spans, row0 = [], 0
        for item in items:
            num_rows = len(item.draft_token_ids) + 1
            if item.seq.sampling_params.structured_outputs is not None:
                spans.append((item, row0, num_rows))
            row0 += num_rows
        if not spans:
            return logits
        for item, _, _ in spans:  # creates the matchers first: the mask width is known after
            self.matcher_for(item.seq)
        bitmask = np.zeros((sum(n for _, _, n in spans), self.num_words), dtype=np.int32)
        rows: list[int] = []
        for item, first, num_rows in spans:
            out = bitmask[len(rows): len(rows) + num_rows]
            try:
                self.matchers[item.seq.seq_id].verify_masks(list(item.draft_token_ids), out)
            except GrammarViolation as e:
                raise SequenceError(item.seq.seq_id, f"structured outputs of request {item.seq.request_id!r}: {e}") from e
            rows.extend(range(first, first + num_rows))
        if copy:
            logits = logits.clone()
        device = logits.device
        apply_token_bitmask(logits, torch.tensor(rows, dtype=torch.int64).to(device),
                            torch.from_numpy(bitmask).to(device), fallback)
        return logits

    def truncate_drafts(self, scheduled: list, results: list, draft_probs: list) -> None:
        """Cut each structured sequence's next drafts (results[i].next_drafts) at the first one its
        grammar rejects after this step's tokens, where that is exact (see the module docstring).
        draft_probs[i]: the proposer's draft distribution for sequence i, or None."""
        for item, result, probs in zip(scheduled, results, draft_probs):
            seq = item.seq
            params = seq.sampling_params
            if params.structured_outputs is None or not item.samples or not result.next_drafts:
                continue
            if probs is not None and not params.greedy:
                continue
            matcher = self.matcher_for(seq)
            try:
                matcher.advance(seq.output_token_ids + list(result.new_token_ids))
            except GrammarViolation as e:
                raise SequenceError(seq.seq_id, f"structured outputs of request {seq.request_id!r}: {e}") from e
            keep = matcher.allowed_prefix(list(result.next_drafts))
            result.next_drafts = list(result.next_drafts[:keep])
