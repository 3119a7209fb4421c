"""SuffixIndex: the suffix structure of suffix decoding (spec_decode/suffix.py), kept as positions
in a token store instead of trie nodes, so that the host work of a step is proportional to the
tokens new in it, not to the tokens times the tree depth.

A node of a suffix trie is a substring; what drafting reads from it is the list of the
substring's occurrences and what follows each. SuffixIndex keeps exactly that, lazily:
  - `tokens`, the store: one sequence (a request's prompt and output) or many (the global cache's
    responses, SEPARATOR between them, the oldest evicted from the front);
  - the occurrences of every gram of key_length tokens, as hash chains (LZ77's): `head` maps
    the gram (its ids packed into one int) to the store position right after its newest
    occurrence, `prev` each such position to the one after the gram's previous occurrence. Flat
    ints only: no Python container per gram, so a large index costs the garbage collector
    nothing. A gram is indexed once the token after it is stored, so a sequence never matches
    its own end.
A Match is a node of the implicit trie: how many tokens of the context's end matched (`length`)
and the store positions right after each occurrence (`positions`, at most MAX_CANDIDATES, the
most recent). It moves with the context: appending token x keeps the positions whose next token
is x, one further on (O(candidates) per token, no re-matching). Once none is left, the next
lookup starts again from the context's last key_length tokens, extends each occurrence
backwards (up to max_depth tokens) and keeps the longest-matching ones: the deepest trie node.

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
Costs: appending n tokens O(n) dict operations (a prompt's time: docs/perf-log.md), a step's advance
O(new tokens x candidates), a lookup one slice compare per candidate (O(max_depth) each at worst),
a draft one slice compare per candidate per run (one for a loop) plus O(candidates) per branching
token, and one slice for a single occurrence.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

SEPARATOR = -1  # between responses in the global cache's store: no context token equals it
TOKEN_BITS = 24  # a gram's ids packed into one int key: every vocabulary is below 2 ** 24
# Occurrences a match follows (the most recent): bounds a lookup's and a walk's host work; the
# trie's counts over more occurrences would change the drafts of frequent short grams only.
MAX_CANDIDATES = 16


@dataclass
class Draft:
    """One candidate continuation: tokens, how long the matched suffix of the context was, and
    the score (the sum of each drafted prefix's empirical probability: the expected number of
    accepted tokens if the empirical model were the target's)."""

    token_ids: list[int]
    match_length: int
    score: float


EMPTY_DRAFT = Draft([], 0, 0.0)


@dataclass
class Match:
    """The context's longest matched suffix in a SuffixIndex: its length, and the store positions
    right after its occurrences (oldest first; empty: no match)."""

    length: int = 0
    positions: list[int] = field(default_factory=list)


class SuffixIndex:
    def __init__(self, key_length: int, max_depth: int):
        if key_length < 1:
            raise ValueError(f"suffix index key_length (the shortest match) must be >= 1, got {key_length}")
        if max_depth < key_length:
            raise ValueError(f"suffix index max_depth must be >= key_length {key_length}, got {max_depth}")
        self.key_length = key_length
        self.max_depth = max_depth
        self.key_mask = (1 << (TOKEN_BITS * key_length)) - 1
        self.tokens: list[int] = []  # the store, from absolute position `base` on
        self.prev: list[int] = []  # per stored position: the previous one after the same gram, or -1
        self.base = 0  # absolute position of tokens[0] (a compacted store dropped what was before)
        self.start = 0  # first live absolute position (the global cache evicts below it)
        self.head: dict[int, int] = {}  # gram key -> the newest absolute position after that gram
        # The key of the store's last key_length tokens while it grows as one sequence (extend);
        # None before it holds that many, and in a store of many sequences (append_sequence).
        # A sequence's step appends a token or a few: this keeps that O(new tokens), no gram
        # packed again, and gives lookup() the context's last gram for free.
        self.tail_key: int | None = None
        self.many_sequences = False  # append_sequence was used: SEPARATOR between sequences

    @property
    def end(self) -> int:
        """Absolute position one past the last stored token."""
        return self.base + len(self.tokens)

    def gram_key(self, gram: list[int]) -> int:
        """The dictionary key of key_length tokens: their ids packed into one int."""
        key = 0
        for t in gram:
            key = (key << TOKEN_BITS) | t
        return key

    # ---- building ------------------------------------------------------------------------
    def _index(self, lo: int, hi: int, key: int | None = None) -> int | None:
        """Index the grams before store indices lo .. hi - 1 (lo >= key_length); key: the gram
        before lo when known. Returns the key of the gram before hi (None: nothing indexed)."""
        if lo >= hi:
            return key
        tokens, prev, head, base, mask = self.tokens, self.prev, self.head, self.base, self.key_mask
        if key is None:
            key = self.gram_key(tokens[lo - self.key_length : lo])
        for i in range(lo, hi):
            prev[i] = head.get(key, -1)
            head[key] = base + i
            key = ((key << TOKEN_BITS) | tokens[i]) & mask
        return key

    def extend(self, new: list[int]) -> None:
        """Append tokens (one growing sequence), indexing every gram the new tokens follow."""
        tokens = self.tokens
        key = self.tail_key
        if len(new) == 1 and key is not None:  # a decode step's token: _index inlined
            self.prev.append(self.head.get(key, -1))
            self.head[key] = self.base + len(tokens)
            tokens.append(new[0])
            self.tail_key = ((key << TOKEN_BITS) | new[0]) & self.key_mask
            return
        first = len(tokens)
        tokens.extend(new)
        self.prev.extend([-1] * len(new))
        if key is None:  # unknown (fewer than key_length tokens were stored): packed from the store
            first = max(first, self.key_length)
            if first > len(tokens):  # still fewer
                return
            key = self.gram_key(tokens[first - self.key_length : first])  # (also when nothing is indexed)
        self.tail_key = self._index(first, len(tokens), key)

    def append_if_unmatched(self, token: int, other_head: dict[int, int]) -> bool:
        """extend([token]) for a sequence whose match has ended, when a lookup after it would find
        nothing: appends the token and returns True when the gram the store then ends with occurs
        neither here nor in other_head (another index's head: the global cache's); else stores
        nothing and returns False. False too before the store holds key_length tokens (no tail key)."""
        old = self.tail_key
        if old is None:
            return False
        key = ((old << TOKEN_BITS) | token) & self.key_mask
        head = self.head
        if key in head or key == old or key in other_head:  # (old: the gram the token's indexing adds)
            return False
        self.prev.append(head.get(old, -1))
        head[old] = self.base + len(self.tokens)
        self.tokens.append(token)
        self.tail_key = key
        return True

    def append_sequence(self, sequence: list[int]) -> None:
        """Append one sequence of many (the global cache): grams inside it only, SEPARATOR after
        (so every occurrence that goes on has its next token in the store)."""
        first = len(self.tokens)
        self.tail_key = None  # many sequences: no one tail
        self.many_sequences = True
        self.tokens.extend(sequence)
        self.tokens.append(SEPARATOR)
        self.prev.extend([-1] * (len(sequence) + 1))
        self._index(first + self.key_length, first + len(sequence))

    def drop_oldest(self, length: int) -> None:
        """Evict the oldest stored sequence (`length` tokens, appended by append_sequence): a gram
        whose newest occurrence was in it leaves the dictionary; older links in the chains point
        below `start` and end the walks there."""
        tokens, head, m, base, mask = self.tokens, self.head, self.key_length, self.base, self.key_mask
        first = self.start - base
        if length > m:
            key = self.gram_key(tokens[first : first + m])
            for i in range(first + m, first + length):
                if head.get(key) == base + i:
                    del head[key]
                key = ((key << TOKEN_BITS) | tokens[i]) & mask
        self.start += length + 1  # its separator too
        dead = self.start - base
        if dead >= len(tokens) or dead > len(tokens) // 2:  # compact: drop the dead front
            del tokens[:dead]
            del self.prev[:dead]
            self.base = self.start

    # ---- matching ------------------------------------------------------------------------
    def lookup(self, context: list[int], key: int | None = None) -> Match:
        """The longest suffix of context (key_length .. max_depth tokens) that occurs here with
        a next token, and its occurrences (at most MAX_CANDIDATES, the most recent). key: the
        gram key of context's last key_length tokens when known (a sequence's tail_key)."""
        m = self.key_length
        n = len(context)
        if n < m:
            return Match()
        p = self.head.get(self.gram_key(context[n - m :]) if key is None else key, -1)
        if p < self.start:  # the gram never occurred (the common case of a step without a match)
            return Match()
        tokens, prev, base, start, max_depth = self.tokens, self.prev, self.base, self.start, self.max_depth
        low = start - base
        full = min(max_depth, n) - m  # the most tokens before the gram an occurrence can match
        before = context[n - m - full : n - m]  # those tokens of the context (one slice for all)
        best_length, best = 0, []
        for _ in range(MAX_CANDIDATES):  # newest first
            if p < start:
                break
            q = p - m - base  # store index of the occurrence's first token
            if q - low >= full and tokens[q - full : q] == before:
                length = m + full  # all of it (a repetitive text's common case): one slice compare
            else:  # back a token at a time, to the store's start at most
                length, q, c = m, q - 1, n - m - 1
                while length < max_depth and q >= low and c >= 0 and tokens[q] == context[c]:
                    length += 1
                    q -= 1
                    c -= 1
            if length > best_length:
                best_length, best = length, [p]
            elif length == best_length:
                best.append(p)
            p = prev[p - base]
        best.reverse()  # oldest first
        return Match(best_length, best) if best else Match()

    def advance(self, match: Match, new: list[int]) -> Match:
        """The match of the context grown by `new` (already stored, for a sequence's own index):
        the occurrences that go on with each new token; an empty Match when none does."""
        positions = match.positions
        if not positions:
            return match
        tokens, base, start = self.tokens, self.base, self.start
        if positions[0] < start:
            positions = [p for p in positions if p >= start]
        n = len(new)
        # An occurrence goes on iff the n stored tokens after it are `new` (a slice shorter than n:
        # it runs into the end): one slice compare per occurrence.
        positions = [p + n for p in positions if tokens[p - base : p - base + n] == new]
        return Match(match.length + n, positions) if positions else Match()

    # ---- drafting ------------------------------------------------------------------------
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
