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

Drafting from a Match: suffix_draft_walk.py (DraftWalk, which SuffixIndex takes its draft() from).
Costs: appending n tokens O(n) dict operations (a prompt's time: docs/perf-log.md), a step's advance
O(new tokens x candidates), a lookup one slice compare per candidate (O(max_depth) each at worst),
a draft one slice compare per candidate per run (one for a loop) plus O(candidates) per branching
token, and one slice for a single occurrence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from foretell.spec_decode.suffix_draft_walk import SEPARATOR, DraftWalk

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

    @property
    def depth(self) -> int:
        """The most tokens a verify can accept from it (a tree's is its longest path)."""
        return len(self.token_ids)


EMPTY_DRAFT = Draft([], 0, 0.0)


@dataclass
class Match:
    """The context's longest matched suffix in a SuffixIndex: its length, and the store positions
    right after its occurrences (oldest first; empty: no match)."""

    length: int = 0
    positions: list[int] = field(default_factory=list)


class SuffixIndex(DraftWalk):
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
