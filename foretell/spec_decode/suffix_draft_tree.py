"""A tree of drafts from a suffix match (speculative_config method "suffix" with topk > 1): where
the match's occurrences go on with different tokens (branches compete), the tree drafts the likely
ones side by side and one verify step tries them all (runner/tree_step.py).

The tree is the implicit trie below the Match (suffix_tree.py), expanded best first: a node is a
continuation of the context, its probability the product of its tokens' empirical probabilities
(count among the occurrences that go on / their number, as the chain's walk counts them,
suffix_draft_walk.py); the root's children and each popped node's children are its topk most
frequent next tokens (ties: the one whose newest occurrence is the most recent), and nodes are
taken in order of probability while it stays >= min_token_prob, at most max_nodes nodes and
max_depth below the root. A parent is never less probable than its child, so the nodes come out
topologically ordered with siblings best first: what DraftTree asks (spec_decode/tree/shape.py).
With topk 1 the tree is the chain's walk, token by token (the same tokens and probabilities).

In a sequence's own store an occurrence that runs past the context's end reads on in the node's
own path (the continuation it drafts), as the chain's walk reads its draft; in the global cache an
occurrence ends at its response's end (SEPARATOR) and counts for none.

Each node's work is a pass over its occurrences (at most MAX_CANDIDATES), so a tree costs
O(max_nodes x candidates) on the host.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from foretell.spec_decode.suffix_draft_walk import SEPARATOR
from foretell.spec_decode.suffix_tree import Match, SuffixIndex


@dataclass
class TreeDraft:
    """Drafted nodes below the root in tree order: their tokens, parents (0: the root, i: the i-th
    drafted node, 1-based as DraftTree numbers nodes), depths (1 below the root) and path
    probabilities; `score` their sum (the expected accepted tokens under the empirical model);
    match_length: the matched suffix's length."""

    token_ids: list[int]
    parents: list[int]
    depths: list[int]
    probs: list[float]
    match_length: int = 0

    @property
    def score(self) -> float:
        return sum(self.probs)

    @property
    def depth(self) -> int:
        """The longest path below the root: the most tokens a verify can accept from it."""
        return max(self.depths, default=0)


EMPTY_TREE = TreeDraft([], [], [], [])


def draft_tree(index: SuffixIndex, match: Match, max_depth: int, max_nodes: int, topk: int,
               min_token_prob: float) -> TreeDraft:
    """The best-first tree below `match` in `index` (module docstring)."""
    positions = match.positions
    if positions and positions[0] < index.start:  # (a held match may meet evicted occurrences)
        positions = [p for p in positions if p >= index.start]
    tree = TreeDraft([], [], [], [], match.length)
    if not positions or max_depth < 1 or max_nodes < 1:
        return tree
    paths: list[list[int]] = [[]]  # per node (0: the root), its tokens below the root
    heap: list[tuple] = []  # (-probability, push order: ties go to the earlier, parent, token, positions)
    pushed = itertools.count()

    def push(parent: int, parent_positions: list[int], parent_prob: float) -> None:
        for prob, token, after in _children(index, parent_positions, paths[parent], parent_prob, topk, min_token_prob):
            heapq.heappush(heap, (-prob, next(pushed), parent, token, after))

    push(0, positions, 1.0)
    while heap and len(tree.token_ids) < max_nodes:
        neg_prob, _, parent, token, after = heapq.heappop(heap)
        path = paths[parent] + [token]
        paths.append(path)
        tree.token_ids.append(token)
        tree.parents.append(parent)
        tree.depths.append(len(path))
        tree.probs.append(-neg_prob)
        if len(path) < max_depth:
            push(len(paths) - 1, after, -neg_prob)
    return tree


def _children(index: SuffixIndex, positions: list[int], path: list[int], prob: float, topk: int,
              min_token_prob: float) -> list[tuple[float, int, list[int]]]:
    """A node's children (at most topk, most frequent first): (probability, token, the positions
    after it), those at or above min_token_prob."""
    tokens, base, end = index.tokens, index.base, index.end
    if max(positions) < end:
        nxt = [tokens[p - base] for p in positions]
    else:  # past the end a sequence's own occurrence reads the path (SEPARATOR: nothing yet)
        nxt = [tokens[p - base] if p < end else (path[p - end] if p - end < len(path) else SEPARATOR)
               for p in positions]
    counts: dict[int, list[int]] = {}  # token -> [count, its newest occurrence's rank]
    for rank, t in enumerate(nxt):
        if t == SEPARATOR:
            continue
        entry = counts.get(t)
        if entry is None:
            counts[t] = [1, rank]
        else:
            entry[0] += 1
            entry[1] = rank
    total = sum(c for c, _ in counts.values())
    ranked = sorted(counts.items(), key=lambda item: (item[1][0], item[1][1]), reverse=True)[:topk]
    children = []
    for t, (count, _) in ranked:
        child_prob = prob * count / total
        if child_prob < min_token_prob:
            break  # (the rest are no more frequent)
        children.append((child_prob, t, [p + 1 for p, u in zip(positions, nxt) if u == t]))
    return children


def accepted_in_tree(tree: TreeDraft, new: list[int]) -> int:
    """How many of a tree's tokens the verify that emitted `new` accepted: the path down the tree
    along new's tokens (the last new token is the target's own, never a draft)."""
    node, accepted = 0, 0
    for token in new[:-1]:
        for i in range(node, len(tree.token_ids)):  # (children come after their parent)
            if tree.parents[i] == node and tree.token_ids[i] == token:
                node, accepted = i + 1, accepted + 1
                break
        else:
            break
    return accepted


def judged_draft(chain: list[int], tree: TreeDraft | None, new: list[int]) -> tuple[int, int]:
    """What the gate learns of the last draft (a chain, or a tree when given) from the tokens its
    verify emitted: (accepted tokens, the most it could have accepted: its length or depth). The
    last new token is the target's own, never a draft."""
    if tree is not None:
        return accepted_in_tree(tree, new), tree.depth
    accepted, limit = 0, min(len(chain), len(new) - 1)
    while accepted < limit and chain[accepted] == new[accepted]:
        accepted += 1
    return accepted, len(chain)
