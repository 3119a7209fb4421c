"""Drafting from a suffix match: the walk down the implicit trie of a SuffixIndex (suffix_tree.py).

Drafting walks down from a Match like the trie walk: at each step the most frequent next token
among the occurrences (ties: the most recent), its empirical probability count / occurrences
that go on, the path's probability the product; it stops below min_token_prob. A single
occurrence is copied in one slice. In a sequence's own store an occurrence that runs into the
context's end keeps copying from the draft itself (a loop drafts on past the end). Where the
occurrences left all go on alike (an ended one counts for none) the walk takes that whole run at
once: one slice compare per occurrence, or one compare for them all when they are equally spaced
(a loop: the tokens from the oldest on repeat with that period); the drafts and scores are the
token-at-a-time walk's (tests/spec_decode/test_suffix_reference_drafts.py holds them to a plain
reference).

DraftWalk holds the walk as methods of the index it is mixed into (SuffixIndex): it reads the
index's token store (`tokens`, `base`, `start`, `end`) and whether it holds many sequences
(`many_sequences`), nothing else.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from foretell.spec_decode.suffix_tree import Match

SEPARATOR = -1  # between responses in the global cache's store: no context token equals it


class DraftWalk:
    """draft() and its runs, for SuffixIndex (module docstring)."""

    tokens: list[int]  # the index's store, from absolute position base on
    base: int
    start: int  # the oldest position still stored
    many_sequences: bool  # the global cache's store (responses between SEPARATORs)
    end: int  # SuffixIndex.end: the position after the store's last token

    def draft(self, match: Match, max_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
        """Walk down from match by the most frequent next token while the path's empirical
        probability stays >= min_token_prob, at most max_tokens tokens. Returns (tokens, score).
        Where the occurrences that go on all go on with the same tokens (a repetitive text's
        common case; ended ones count for none) the walk takes that whole run at once
        (_agreed_run: one slice compare per occurrence, past the store's end too) instead of a
        token at a time; the result is the token-at-a-time walk's, score included."""
        tokens, base, end = self.tokens, self.base, self.end
        positions = match.positions
        if positions and positions[0] < self.start:  # oldest first: only a held match meets evicted ones
            positions = [p for p in positions if p >= self.start]
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while positions and len(draft) < max_tokens:
            if len(positions) == 1:  # one occurrence: copy it (its probability stays)
                copied = self._copy(positions[0], max_tokens - len(draft), draft)
                score += prob * copied
                break
            if prob >= min_token_prob:
                run, positions_after = self._agreed_run(positions, max_tokens - len(draft), draft)
                if run:
                    for _ in range(run):  # each with probability 1: prob stays, the score gains it each
                        score += prob
                    positions = positions_after
                    continue
            # A branch (or the walk's end): one token, the most frequent next one.
            if max(positions) < end:  # every occurrence's next token is in the store
                nxt = [tokens[p - base] for p in positions]  # each occurrence's next token, oldest first
            else:  # past the end a sequence's own occurrence reads the draft (SEPARATOR: nothing yet)
                nxt = [tokens[p - base] if p < end else (draft[p - end] if p - end < len(draft) else SEPARATOR)
                       for p in positions]
            distinct = set(nxt)
            distinct.discard(SEPARATOR)  # an occurrence that ends (a response's end) counts for none
            if not distinct:
                break
            total = len(nxt) - nxt.count(SEPARATOR)
            if len(distinct) == 1:  # one continuation (a probability below min_token_prob: the end)
                choice, count = distinct.pop(), total
            else:  # the most frequent; ties: the one whose newest occurrence is the most recent
                newest_first = nxt[::-1]
                best = None
                for t in distinct:
                    rank = (nxt.count(t), -newest_first.index(t))
                    if best is None or rank > best:
                        best, choice = rank, t
                count = best[0]
            prob *= count / total
            if prob < min_token_prob:
                break
            draft.append(choice)
            score += prob
            positions = [p + 1 for p, t in zip(positions, nxt) if t == choice]
        return draft, score

    def _agreed_run(self, positions: list[int], n: int, draft: list[int]) -> tuple[int, list[int]]:
        """The steps (at most n) the token-at-a-time walk would take from positions (two or more,
        oldest first) with one continuation each: the occurrences not yet ended all go on with the
        same token, and two or more occurrences are left. Appends those tokens to draft; returns
        how many and the positions after them (those not ended before). 0: the next step branches
        or ends. One slice compare per occurrence against the run (`ref`)."""
        if self.many_sequences:
            return self._agreed_run_across_sequences(positions, n, draft)
        # A sequence's own store: no occurrence ends, each goes on n tokens; one that runs past
        # the store's end reads on in the draft, then in the run itself (what the walk reads).
        tokens, base, end = self.tokens, self.base, self.end
        oldest = positions[0]
        ref = tokens[oldest - base : oldest - base + n]
        late = bisect_right(positions, end - n)  # positions[late:] run past the end
        if late < len(positions):
            from_late = positions[late]
            # the tokens from positions[late] on: the store's, the draft's, then the run's
            known = tokens[from_late - base :] + draft[max(0, from_late - end) :]
            if late == 0:  # the run repeats what the oldest occurrence reads before the run
                ref = known[:n] if len(known) >= n else (known * (n // len(known) + 1))[:n]
            window = known + ref
        newest, count = positions[-1], len(positions)
        spacing = (newest - oldest) // (count - 1)
        if spacing <= n and positions == list(range(oldest, newest + 1, spacing)):
            # Equally spaced (a loop of that period): they all go on alike iff the tokens from the
            # oldest occurrence through the newest one's n repeat with that period (one compare).
            span = newest - oldest + n
            if late == 0:
                tail = window[:span]
            elif late == count:
                tail = tokens[oldest - base : oldest - base + span]
            else:
                tail = tokens[oldest - base : from_late - base] + window[: newest - from_late + n]
            if tail[spacing:] == tail[: span - spacing]:
                draft.extend(ref)
                return n, [p + n for p in positions]
        run = n
        for k in range(1, count):
            p = positions[k]
            if k < late:
                piece = tokens[p - base : p - base + n]
            else:
                piece = window[p - from_late : p - from_late + n]
            if piece != ref:
                j = _agreeing_length(piece, ref)
                if j < run:
                    if j == 0:
                        return 0, positions
                    run = j
        draft.extend(ref[:run])
        return run, [p + run for p in positions]

    def _agreed_run_across_sequences(self, positions: list[int], n: int, draft: list[int]) -> tuple[int, list[int]]:
        """_agreed_run in a store of many sequences (the global cache): an occurrence ends at the
        SEPARATOR after its sequence (the store ends with one: no occurrence runs past it); the
        run is the continuation of the one that lasts longest (the oldest among equals) and
        stops where fewer than two occurrences are left (the walk then copies the last one)."""
        tokens, base = self.tokens, self.base
        oldest, newest, count = positions[0], positions[-1], len(positions)
        spacing = (newest - oldest) // (count - 1)
        if spacing <= n and positions == list(range(oldest, newest + 1, spacing)):
            # Equally spaced (a loop): within one sequence, they all go on alike (each until the
            # sequence ends) iff its tokens from the oldest occurrence on repeat with that period.
            span = tokens[oldest - base : newest - base + n]
            if SEPARATOR in span:
                span = span[: span.index(SEPARATOR)]
            if len(span) > newest - oldest and span[spacing:] == span[: len(span) - spacing]:
                longest = min(n, len(span))  # the oldest's, then each next one's spacing fewer
                run = min(longest, len(span) - spacing + 1)
                draft.extend(span[:run])
                last_kept = oldest + len(span) - run  # positions above it end before the run's end
                return run, [p + run for p in positions if p <= last_kept]
        pieces, lasts = [], []  # per occurrence: its next tokens (at most n), and how many before it ends
        for p in positions:
            piece = tokens[p - base : p - base + n]
            if SEPARATOR in piece:
                piece = piece[: piece.index(SEPARATOR)]
            pieces.append(piece)
            lasts.append(len(piece))
        longest = max(lasts)
        if longest == 0:
            return 0, positions
        i_ref = lasts.index(longest)
        ref = pieces[i_ref]
        run = min(longest, sorted(lasts)[-2] + 1)  # two occurrences left at each step (one: the walk copies)
        for i, piece in enumerate(pieces):
            if i != i_ref and piece != ref[: len(piece)]:
                j = _agreeing_length(piece, ref)  # they differ before len(piece)
                if j < run:
                    if j == 0:
                        return 0, positions
                    run = j
        draft.extend(ref[:run])
        return run, [p + run for p, last in zip(positions, lasts) if last >= run]

    def _copy(self, p: int, n: int, draft: list[int]) -> int:
        """Append up to n tokens following position p to draft (stopping at a SEPARATOR); past
        the store's end the copy reads the draft itself (what it copies continues the context).
        Returns how many were appended."""
        tokens, base, end = self.tokens, self.base, self.end
        before = len(draft)
        if p < end:
            piece = tokens[p - base : p - base + n]
            if SEPARATOR in piece:
                piece = piece[: piece.index(SEPARATOR)]
                draft.extend(piece)
                return len(draft) - before
            draft.extend(piece)
            p += len(piece)
        while len(draft) - before < n and p - end < len(draft):
            draft.append(draft[p - end])
            p += 1
        return len(draft) - before


def _agreeing_length(piece: list[int], ref: list[int]) -> int:
    """How many leading tokens piece and ref share (they differ within both's length)."""
    j = 0
    while piece[j] == ref[j]:
        j += 1
    return j
