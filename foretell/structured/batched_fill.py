"""The masks of a whole step in one llguidance call (two when some sequences verify no drafts):
LLExecutor fills every structured sequence's rows at once (in parallel on its own threads,
without the GIL), where SequenceMatcher.verify_masks walks one sequence at a time.

fill_verify_masks(): a verify step's rows for every sequence (row j as if drafts d_0..d_{j-1} had
been accepted). llguidance's draft walk consumes each draft, writes the row after it and rolls
back; it stops at the first draft the grammar cannot take and leaves the rows after that one as
they were. Then each sequence's rows are turned into ours on the host: the end tokens' bits
become the sequence's EOS ids (SequenceMatcher.set_end_tokens, with "may end here" read from the
grammar's own end token's bit, which llguidance sets exactly where its parser accepts), the walk
is cut at an EOS draft or one our row forbids, and the rows past the cut repeat the cut's row.
The result is the same as verify_masks' (tests/structured/test_draft_masks.py holds them together).
The two halves are walk_drafts() (llguidance's calls: walk_calls() builds them, a worker thread
may run them: verify_rows.VerifyRows.fill_ahead) and finish_rows() (ours, on the engine's thread).
"""

from __future__ import annotations

import numpy as np

from foretell.structured.matcher import GrammarViolation, SequenceMatcher


class SequenceGrammarViolation(GrammarViolation):
    """A GrammarViolation of one sequence of a batched fill: index is its place in the batch."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def grammar_may_end(matcher: SequenceMatcher, raw_row: np.ndarray) -> bool:
    token = matcher.grammar_eos_token_id
    if token is None or token >= raw_row.shape[0] * 32:
        return False
    return bool((int(raw_row.view(np.uint32)[token >> 5]) >> (token & 31)) & 1)


def fill_verify_masks(
    executor,  # llguidance.LLExecutor
    matchers: list[SequenceMatcher],
    drafts: list[list[int]],  # per sequence: its k_i drafts
    out: np.ndarray,  # [sum(k_i + 1), words] int32, C-contiguous: each sequence's rows in turn
) -> list[int]:
    """Fill every sequence's k_i + 1 rows; returns how many drafts each one's grammar takes in a
    row (its rows up to that one are exact masks). The matchers end where they started."""
    walk_drafts(executor, matchers, drafts, out)
    return finish_rows(matchers, drafts, out)


def walk_drafts(executor, matchers: list[SequenceMatcher], drafts: list[list[int]], out: np.ndarray) -> None:
    """llguidance's part of fill_verify_masks: its rows as it writes them."""
    for call, args in walk_calls(executor, matchers, drafts, out):
        call(*args)


def walk_calls(executor, matchers: list[SequenceMatcher], drafts: list[list[int]], out: np.ndarray) -> list:
    """walk_drafts' llguidance calls as (bound method, arguments), built here: a worker thread
    that runs them holds the GIL only to enter and leave each (llguidance releases it inside)."""
    jobs, row = [], 0
    for matcher, draft in zip(matchers, drafts):
        # An EOS ends the output: the walk stops before it (it is no grammar text).
        cut = next((j for j, t in enumerate(draft) if t in matcher.eos_token_ids), len(draft))
        jobs.append((matcher.matcher, row, list(draft[:cut])))
        row += len(draft) + 1
    if row != out.shape[0] or not out.flags["C_CONTIGUOUS"]:
        raise ValueError(f"fill_verify_masks needs {row} contiguous rows, got {out.shape[0]}")
    # llguidance refuses an empty draft list: rows with no drafts to walk take the plain call.
    with_drafts = [job for job in jobs if job[2]]
    without = [(matcher, row) for matcher, row, draft in jobs if not draft]
    where = (out.ctypes.data, out.shape[1] * 4, out.shape[0])
    calls = []
    if with_drafts:
        calls.append((executor.unsafe_compute_mask_ptr_with_draft_token, (with_drafts, *where)))
    if without:
        calls.append((executor.unsafe_compute_mask_ptr, (without, *where)))
    return calls


def finish_rows(matchers: list[SequenceMatcher], drafts: list[list[int]], out: np.ndarray) -> list[int]:
    """Our part: the end tokens, the walk's cut, the rows past it (see the module docstring)."""
    taken_counts, first = [], 0
    for index, (matcher, draft) in enumerate(zip(matchers, drafts)):
        if matcher.matcher.is_error():
            raise SequenceGrammarViolation(index, f"the grammar failed: {matcher.matcher.get_error()}")
        rows = out[first: first + len(draft) + 1]
        first += len(draft) + 1
        taken = 0
        while True:
            if not matcher.set_end_tokens(rows[taken], grammar_may_end(matcher, rows[taken])):
                raise SequenceGrammarViolation(
                    index, "the grammar allows no token here and the output cannot end (no EOS token id known)"
                )
            if taken == len(draft):
                break
            token = draft[taken]
            if token in matcher.eos_token_ids or not SequenceMatcher.allows(rows[taken], token):
                break
            taken += 1
        rows[taken + 1:] = rows[taken]
        taken_counts.append(taken)
    return taken_counts
