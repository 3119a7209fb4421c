"""SequenceMatcher: one sequence's grammar state (an llguidance LLMatcher) and what a speculative
step asks of it.

The state follows the sequence's output tokens (advance()). For a verify step of drafts
d_0..d_{k-1} it fills k + 1 packed bitmask rows: row j is the mask after d_0..d_{j-1} (as if they
had been accepted), found by consuming the drafts one by one; it stops at the first draft the
grammar rejects (or an EOS): that row's mask decides the token there, and the rows after it, which
the verifier never emits from, repeat it. Then it rolls back to where it was; the tokens the step
emits are consumed by the next advance(). allowed_prefix() is the same walk without masks: how
many of a proposer's drafts the grammar can take, to cut the rest before they are verified.

End of output: the grammar's own end token stands for the sequence's EOS ids. Where the grammar
may end (is_accepting), every EOS id is allowed; where it must end, only they are.
"""

from __future__ import annotations

import numpy as np


class GrammarViolation(ValueError):
    """A token the grammar cannot take reached the matcher, or no token is allowed."""


class SequenceMatcher:
    def __init__(self, matcher, eos_token_ids: list[int], grammar_eos_token_id: int | None, num_words: int):
        self.matcher = matcher  # llguidance.LLMatcher
        self.eos_token_ids = sorted(eos_token_ids)
        # Bits cleared from every mask before the EOS ids are set: the grammar's end token and ours.
        self.end_token_ids = sorted(set(eos_token_ids) | ({grammar_eos_token_id} if grammar_eos_token_id is not None else set()))
        self.end_token_ids = [t for t in self.end_token_ids if t < num_words * 32]
        self.grammar_eos_token_id = grammar_eos_token_id  # its bit in a raw row: the grammar may end there
        self.num_words = num_words
        self.num_consumed = 0  # output tokens advanced through
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarViolation(f"the grammar failed: {self.matcher.get_error()}")

    def advance(self, output_token_ids: list[int]) -> None:
        """Consume the output tokens not yet consumed (EOS ids are the end of the output, not
        grammar text: they are skipped)."""
        for token in output_token_ids[self.num_consumed:]:
            if token not in self.eos_token_ids and not self.matcher.consume_token(token):
                raise GrammarViolation(
                    f"output token {token} (position {self.num_consumed}) does not match the grammar: "
                    f"{self.matcher.get_error()}"
                )
            self.num_consumed += 1

    def fill_mask(self, row: np.ndarray) -> None:
        """row [num_words] int32: the tokens allowed next."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self._check()
        if not self.set_end_tokens(row, self.matcher.is_accepting()):
            raise GrammarViolation(
                "the grammar allows no token here and the output cannot end (no EOS token id known)"
            )

    def set_end_tokens(self, row: np.ndarray, accepting: bool) -> bool:
        """Turn a row as llguidance writes it into ours: the end tokens' bits cleared, then every
        EOS id set where the grammar may end here (accepting). Returns whether any token is allowed."""
        bits = row.view(np.uint32)
        for token in self.end_token_ids:
            bits[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)
        if accepting:
            for token in self.eos_token_ids:
                bits[token >> 5] |= np.uint32(1 << (token & 31))
        return bool(bits.any())

    @staticmethod
    def allows(row: np.ndarray, token: int) -> bool:
        return bool((int(row.view(np.uint32)[token >> 5]) >> (token & 31)) & 1)

    def verify_masks(self, draft_token_ids: list[int], out: np.ndarray) -> int:
        """Fill out [k + 1, num_words] int32 for a verify of these k drafts; returns how many
        drafts the grammar takes in a row (the rows up to that one are exact masks)."""
        self.fill_mask(out[0])
        taken = 0
        for j, token in enumerate(draft_token_ids):
            if token in self.eos_token_ids or not self.allows(out[j], token):
                break
            if not self.matcher.consume_token(token):
                raise GrammarViolation(f"draft {token} passed the mask but not the grammar: {self.matcher.get_error()}")
            taken += 1
            self.fill_mask(out[j + 1])
        out[taken + 1:] = out[taken]
        if taken:
            self.matcher.rollback(taken)
        return taken

    def allowed_prefix(self, draft_token_ids: list[int]) -> int:
        """How many of these drafts, from the first, the grammar can take (an EOS counts where
        the grammar may end there, and nothing after it does)."""
        first_eos = next((j for j, t in enumerate(draft_token_ids) if t in self.eos_token_ids), len(draft_token_ids))
        taken = self.matcher.try_consume_tokens(draft_token_ids[:first_eos]) if first_eos else 0
        keep = taken + 1 if taken == first_eos < len(draft_token_ids) and self.matcher.is_accepting() else taken
        if taken:
            self.matcher.rollback(taken)
        return keep
