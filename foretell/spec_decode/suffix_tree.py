"""SuffixTrie: a bounded-depth suffix trie with occurrence counts, the data structure of suffix
decoding (spec_decode/suffix.py).

Every substring of at most max_depth tokens of the inserted sequences is a path from the root;
a node counts how often its substring occurs (`count`) and how many of those occurrences go on
with a next token (`out`, the sum of its children's counts), so child.count / node.out is the
empirical probability of that next token after the substring. Each node also remembers its most
frequent child (ties go to the newest), so a draft walks down in O(1) per token.

Nodes live in flat lists of ints indexed by node id (the root is 0) and one dict of edges,
(parent id * TOKEN_STRIDE + token) -> child id: no Python object per node, so a trie of millions
of nodes costs the garbage collector nothing and appending allocates almost nothing. Each node
keeps its count, out, most frequent child (-1: none) and token; a removable trie (the global
cache's) also keeps first child / next sibling, to list children when an eviction must find a
new most frequent one. A node's depth is its index in an active list, or counted by the walk.

Sequences grow one token at a time: an "active" list holds the nodes of the sequence's last 0 ..
max_depth - 1 tokens, and appending token x extends each of them by x, so appending costs
O(max_depth) dictionary operations whatever the sequence's length. Removing a sequence (the
global cache's eviction, suffix_cache.py) replays the same walk with decrements and frees nodes
whose count reaches zero.
"""

from __future__ import annotations

from dataclasses import dataclass

TOKEN_STRIDE = 1 << 24  # above any vocabulary size


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
    def __init__(self, max_depth: int, removable: bool = False):
        if max_depth < 2:
            raise ValueError(f"suffix trie max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.count = [0]  # per node: occurrences of its substring
        self.out = [0]  # per node: occurrences followed by a next token (sum of children's counts)
        self.best = [-1]  # per node: its most frequent child (ties: the newest), -1 if none
        self.token = [-1]  # per node: the last token of its substring
        self.removable = removable
        self.first_child = [-1]  # only kept when removable
        self.next_sibling = [-1]
        self.edges: dict[int, int] = {}  # parent * TOKEN_STRIDE + token -> child
        self.free: list[int] = []  # ids of removed nodes, reused first

    @property
    def num_nodes(self) -> int:
        return len(self.count) - len(self.free)

    def _new_node(self, parent: int, x: int) -> int:
        """A new child x of parent with count 1 (a freed id when there is one)."""
        if self.free:
            node = self.free.pop()
            self.count[node], self.out[node], self.best[node], self.token[node] = 1, 0, -1, x
        else:
            node = len(self.count)
            self.count.append(1)
            self.out.append(0)
            self.best.append(-1)
            self.token.append(x)
            self.first_child.append(-1)
            self.next_sibling.append(-1)
        if self.removable:
            self.first_child[node] = -1
            self.next_sibling[node] = self.first_child[parent]
            self.first_child[parent] = node
        self.edges[parent * TOKEN_STRIDE + x] = node
        return node

    # ---- building ------------------------------------------------------------------------
    def extend(self, active: list[int], tokens: list[int]) -> list[int]:
        """Append tokens to the sequence whose active suffix nodes (depths 0, 1, ..., in order,
        the root first) are `active`; returns the new active list (at most max_depth nodes)."""
        count, out, best, edges = self.count, self.out, self.best, self.edges
        token, removable = self.token, self.removable
        max_active = self.max_depth
        for x in tokens:
            fresh = [0]
            for node in active:
                key = node * TOKEN_STRIDE + x
                child = edges.get(key)
                if child is not None:
                    count[child] += 1
                elif removable:
                    child = self._new_node(node, x)
                else:  # _new_node inlined: in new text most appends create nodes
                    child = edges[key] = len(count)
                    count.append(1)
                    out.append(0)
                    best.append(-1)
                    token.append(x)
                out[node] += 1
                b = best[node]
                if b != child and (b < 0 or count[child] >= count[b]):
                    best[node] = child
                fresh.append(child)
            count[0] += 1
            active = fresh if len(fresh) <= max_active else fresh[:max_active]
        return active

    def insert(self, tokens: list[int]) -> None:
        """Insert a whole sequence (every substring of at most max_depth tokens)."""
        self.extend([0], tokens)

    def remove(self, tokens: list[int]) -> None:
        """Undo insert(tokens) of a sequence inserted earlier (counts down, empty nodes freed)."""
        if not self.removable:
            raise ValueError("this suffix trie was built without removable=True")
        count, out, best, edges = self.count, self.out, self.best, self.edges
        active = [0]
        for x in tokens:
            fresh = [0]
            for node in active:
                child = edges[node * TOKEN_STRIDE + x]
                count[child] -= 1
                out[node] -= 1
                if count[child] == 0:
                    self._unlink(node, child, x)
                if best[node] == child:
                    best[node] = self._most_frequent_child(node)
                fresh.append(child)
            count[0] -= 1
            active = fresh[: self.max_depth]

    def _unlink(self, parent: int, child: int, x: int) -> None:
        del self.edges[parent * TOKEN_STRIDE + x]
        previous, node = -1, self.first_child[parent]
        while node != child:
            previous, node = node, self.next_sibling[node]
        if previous < 0:
            self.first_child[parent] = self.next_sibling[child]
        else:
            self.next_sibling[previous] = self.next_sibling[child]
        # Its own children are all at count 0 too (each of their occurrences was one of its
        # own): the walk frees them as it reaches them.
        self.free.append(child)

    def _most_frequent_child(self, node: int) -> int:
        best, best_count = -1, 0
        child = self.first_child[node]
        while child >= 0:
            if self.count[child] > best_count:
                best, best_count = child, self.count[child]
            child = self.next_sibling[child]
        return best

    # ---- matching and drafting -----------------------------------------------------------
    def find(self, tokens: list[int]) -> int:
        """The node of the path `tokens` from the root, or -1."""
        node, edges = 0, self.edges
        for x in tokens:
            node = edges.get(node * TOKEN_STRIDE + x, -1)
            if node < 0:
                return -1
        return node

    def suffix_nodes(self, context: list[int]) -> list[int]:
        """The active list of a context against this trie: the nodes of its longest suffixes that
        are paths here, depths 0 .. L in order (every suffix of a path is a path, so they are
        contiguous), L < max_depth."""
        length = min(len(context), self.max_depth - 1)
        # the longest suffix that is a path, by bisection on its length (monotone, see above)
        lo, hi = 0, length
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.find(context[len(context) - mid :]) >= 0:
                lo = mid
            else:
                hi = mid - 1
        return [self.find(context[len(context) - d :]) if d else 0 for d in range(lo + 1)]

    def advance(self, active: list[int], tokens: list[int]) -> list[int]:
        """Follow a context that grows by tokens without inserting it: `active` holds the
        nodes of its suffixes that are paths here (depths 0 .. L, as suffix_nodes returns);
        the new list likewise."""
        edges, limit = self.edges, self.max_depth - 1
        for x in tokens:
            fresh = [0]
            for node in active[:limit]:
                child = edges.get(node * TOKEN_STRIDE + x)
                if child is None:  # suffixes are nested: no longer one goes on with x either
                    break
                fresh.append(child)
            active = fresh
        return active

    def longest_continuing(self, active: list[int]) -> tuple[int, int]:
        """The deepest non-root node of an active list with a continuation (out > 0) and its
        depth, or (-1, 0)."""
        out = self.out
        for depth in range(len(active) - 1, 0, -1):
            if out[active[depth]] > 0:
                return active[depth], depth
        return -1, 0

    def draft(self, node: int, depth: int, context: list[int], max_tokens: int, min_token_prob: float,
              anchor_length: int) -> tuple[list[int], float]:
        """Walk down from `node` (the path of context's last `depth` tokens) by most
        frequent child while the path's empirical probability stays >= min_token_prob, at most
        max_tokens tokens. Where the path ends (max_depth, or a substring seen only at the end
        of a sequence) the walk re-anchors on a shorter tail of context + draft: at most
        anchor_length tokens, always a path (every suffix of a path is one). So drafts may be
        longer than the trie is deep, and a loop near the end of the context keeps going.
        Returns (tokens, score)."""
        count, out, best, token = self.count, self.out, self.best, self.token
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        max_depth = self.max_depth
        while len(tokens) < max_tokens:
            if depth >= max_depth or out[node] == 0:
                length = min(anchor_length, depth - 1)
                if length < 1:
                    break
                tail = context[max(0, len(context) - length) :] + tokens if len(tokens) < length else tokens
                node = self.find(tail[len(tail) - length :])
                if node < 0:  # cannot happen for a path of this trie; stay safe
                    break
                depth = length
                continue
            child = best[node]
            prob *= count[child] / out[node]
            if prob < min_token_prob:
                break
            tokens.append(token[child])
            score += prob
            node = child
            depth += 1
        return tokens, score
