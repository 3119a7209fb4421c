"""SuffixTrie: a bounded-depth suffix trie with occurrence counts, the data structure of suffix
decoding (spec_decode/suffix.py).

Every substring of at most max_depth tokens of the inserted sequences is a path from the root;
a node counts how often its substring occurs (`count`) and how many of those occurrences go on
with a next token (`out`, the sum of its children's counts), so child.count / node.out is the
empirical probability of that next token after the substring. Each node also remembers its most
frequent child (ties go to the newest), so a draft walks down in O(1) per token.

A node is a small list (faster and smaller than an object in CPython):
    [count, out, children (dict token -> node, or None for a leaf), best token (-1: none), depth]

Sequences grow one token at a time: a `Cursor` holds the nodes of the sequence's last 0 ..
max_depth - 1 tokens (the "active" suffixes), and appending token x extends each of them by x,
so appending costs O(max_depth) dictionary operations whatever the sequence's length. Removing a
sequence (the global cache's eviction, suffix_cache.py) replays the same walk with decrements and
drops nodes whose count reaches zero.
"""

from __future__ import annotations

from dataclasses import dataclass

COUNT, OUT, CHILDREN, BEST, DEPTH = 0, 1, 2, 3, 4


def new_node(depth: int) -> list:
    return [0, 0, None, -1, depth]


@dataclass
class Draft:
    """One candidate continuation: tokens, how long the matched suffix of the context was, and
    the score (the sum of each drafted prefix's empirical probability: the expected number of
    accepted tokens if the empirical model were the target's)."""

    token_ids: list[int]
    match_length: int
    score: float


EMPTY_DRAFT = Draft([], 0, 0.0)


class SuffixTrie:
    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError(f"suffix trie max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = new_node(0)
        self.num_nodes = 1

    # ---- building ------------------------------------------------------------------------
    def extend(self, active: list[list], tokens: list[int]) -> list[list]:
        """Append tokens to the sequence whose active suffix nodes (depths 0, 1, ..., in order,
        the root first) are `active`; returns the new active list (at most max_depth nodes)."""
        max_active = self.max_depth
        for x in tokens:
            fresh = [self.root]
            for node in active:
                children = node[2]
                if children is None:
                    children = node[2] = {}
                child = children.get(x)
                if child is None:
                    child = children[x] = [1, 0, None, -1, node[4] + 1]
                    self.num_nodes += 1
                else:
                    child[0] += 1
                node[1] += 1
                best = node[3]
                if best != x and (best < 0 or child[0] >= children[best][0]):
                    node[3] = x
                if len(fresh) < max_active:
                    fresh.append(child)
            self.root[0] += 1
            active = fresh
        return active

    def insert(self, tokens: list[int]) -> None:
        """Insert a whole sequence (every substring of at most max_depth tokens)."""
        self.extend([self.root], tokens)

    def remove(self, tokens: list[int]) -> None:
        """Undo insert(tokens) of a sequence inserted earlier (counts down, empty nodes dropped)."""
        active = [self.root]
        for x in tokens:
            fresh = [self.root]
            for node in active:
                children = node[2]
                child = children[x]
                child[0] -= 1
                node[1] -= 1
                if child[0] == 0:
                    del children[x]
                    self.num_nodes -= 1
                    if not children:
                        node[2] = None
                if node[3] == x:
                    node[3] = _most_frequent(node[2])
                if len(fresh) < self.max_depth:
                    fresh.append(child)
            self.root[0] -= 1
            active = fresh

    # ---- matching and drafting -----------------------------------------------------------
    def find(self, tokens: list[int]) -> list | None:
        """The node of the path `tokens` from the root, or None."""
        node = self.root
        for x in tokens:
            children = node[2]
            if children is None:
                return None
            node = children.get(x)
            if node is None:
                return None
        return node

    def suffix_nodes(self, context: list[int]) -> list[list]:
        """The active list of a context against this trie: the nodes of its longest suffixes that
        are paths here, depths 0 .. L in order (every suffix of a path is a path, so they are
        contiguous), L < max_depth."""
        length = min(len(context), self.max_depth - 1)
        # the longest suffix that is a path, by bisection on its length (monotone, see above)
        lo, hi = 0, length
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.find(context[len(context) - mid :]) is not None:
                lo = mid
            else:
                hi = mid - 1
        return [self.find(context[len(context) - d :]) if d else self.root for d in range(lo + 1)]

    def advance(self, active: list[list], tokens: list[int]) -> list[list]:
        """Follow a context that grows by tokens without inserting it: `active` holds the
        nodes of its suffixes that are paths here (depths 0 .. L, as suffix_nodes returns);
        the new list likewise."""
        limit = self.max_depth - 1
        for x in tokens:
            fresh = [self.root]
            for node in active:
                children = node[2]
                # suffixes are nested: once one does not go on with x, no longer one does
                child = children.get(x) if children is not None and node[4] < limit else None
                if child is None:
                    break
                fresh.append(child)
            active = fresh
        return active

    def draft(self, node: list, context: list[int], max_tokens: int, min_token_prob: float,
              anchor_length: int) -> tuple[list[int], float]:
        """Walk down from `node` (the path of context's last node[DEPTH] tokens) by most
        frequent child while the path's empirical probability stays >= min_token_prob, at most
        max_tokens tokens. Where the path ends (max_depth, or a substring seen only at the end
        of a sequence) the walk re-anchors on a shorter tail of context + draft: at most
        anchor_length tokens, always a path (every suffix of a path is one). So drafts may be
        longer than the trie is deep, and a loop near the end of the context keeps going.
        Returns (tokens, score)."""
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        max_depth = self.max_depth
        while len(tokens) < max_tokens:
            depth = node[4]
            if depth >= max_depth or node[1] == 0:
                length = min(anchor_length, depth - 1)
                if length < 1:
                    break
                tail = context[max(0, len(context) - length) :] + tokens if len(tokens) < length else tokens
                node = self.find(tail[len(tail) - length :])
                if node is None:  # cannot happen for a path of this trie; stay safe
                    break
                continue
            x = node[3]
            child = node[2][x]
            prob *= child[0] / node[1]
            if prob < min_token_prob:
                break
            tokens.append(x)
            score += prob
            node = child
        return tokens, score


def _most_frequent(children: dict | None) -> int:
    if not children:
        return -1
    best, best_count = -1, 0
    for token, child in children.items():
        if child[0] >= best_count:
            best, best_count = token, child[0]
    return best


def longest_continuing(active: list[list]) -> list | None:
    """The deepest node of an active list that has a continuation (out > 0), or None."""
    for node in reversed(active):
        if node[1] > 0 and node[4] > 0:
            return node
    return None
