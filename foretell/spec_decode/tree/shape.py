"""The shape of a draft tree and the tree itself (batched, on the device).

SGLang's parameters: num_speculative_tokens is the depth (draft forward steps), topk the children
expanded per node and the nodes kept per depth, num_draft_tokens the verify rows per sequence
INCLUDING the root (the sequence's last token, whose target row yields the first correction).
topk 1 with num_draft_tokens = depth + 1 is today's chain.

A DraftTree holds B sequences' trees of T = num_draft_tokens nodes each. Node 0 is the root; nodes
are topologically ordered (a parent's index is below its children's) and siblings are in the
order the draft ranked them (best first), which is the order verification tries them in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeShape:
    num_speculative_tokens: int  # depth: draft steps, the longest path below the root
    topk: int  # children expanded per node and nodes kept per depth
    num_draft_tokens: int  # verify rows per sequence, the root included

    def __post_init__(self):
        for name in ("num_speculative_tokens", "topk", "num_draft_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")
        if self.num_draft_tokens < 2:
            raise ValueError(
                f"speculative_config num_draft_tokens counts the root too: it must be at least 2, "
                f"got {self.num_draft_tokens}"
            )
        if self.num_draft_tokens - 1 > self.pool_size:
            raise ValueError(
                f"speculative_config num_draft_tokens={self.num_draft_tokens} asks for more nodes than "
                f"num_speculative_tokens={self.num_speculative_tokens} and topk={self.topk} draft "
                f"({self.pool_size} candidates + the root): use at most {self.pool_size + 1}"
            )

    @property
    def depth(self) -> int:
        return self.num_speculative_tokens

    @property
    def pool_size(self) -> int:
        """Candidates drafted: topk at depth 1, topk * topk (topk children of topk nodes) below."""
        return self.topk + (self.depth - 1) * self.topk * self.topk

    @classmethod
    def chain(cls, num_speculative_tokens: int) -> "TreeShape":
        return cls(num_speculative_tokens, 1, num_speculative_tokens + 1)


@dataclass
class DraftTree:
    shape: TreeShape
    tokens: torch.Tensor  # [B, T] int64, node 0 the root's (already accepted) token
    parents: torch.Tensor  # [B, T] int64, -1 for the root
    depths: torch.Tensor  # [B, T] int64, 0 for the root: the position offset of each verify row
    ancestor_mask: torch.Tensor  # [B, T, T] bool: row i sees node j iff j is i or an ancestor of i
    scores: torch.Tensor  # [B, T] float32, log path probability under the draft (root 0)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def position_offsets(self) -> torch.Tensor:  # [B, T]: a verify row's position = context length + this
        return self.depths

    FIELDS = ("tokens", "parents", "depths", "ancestor_mask", "scores")  # the per-sequence tensors

    @classmethod
    def stack(cls, trees: list["DraftTree"]) -> "DraftTree":
        """The trees of several batches (one node count) as one batch, in order."""
        if len(trees) == 1:
            return trees[0]
        return cls(trees[0].shape, *(torch.cat([getattr(t, f) for t in trees]) for f in cls.FIELDS))

    def row(self, j: int) -> "DraftTree":
        """Sequence j's tree, a batch of one (views)."""
        return DraftTree(self.shape, *(getattr(self, f)[j: j + 1] for f in self.FIELDS))

    def take(self, picked: torch.Tensor) -> "DraftTree":
        """The trees at rows `picked` ([m] int64)."""
        return DraftTree(self.shape, *(getattr(self, f)[picked] for f in self.FIELDS))

    def cut(self, num_nodes: int) -> "DraftTree":
        """The first num_nodes nodes: a tree again (topological order), the verify rows the scheduler kept."""
        if num_nodes == self.num_nodes:
            return self
        return DraftTree(self.shape, self.tokens[:, :num_nodes], self.parents[:, :num_nodes],
                         self.depths[:, :num_nodes], self.ancestor_mask[:, :num_nodes, :num_nodes],
                         self.scores[:, :num_nodes])


def ancestor_mask_from_parents(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, T] parents (topologically ordered, -1 at the root) -> [B, T, T] bool ancestor-or-self
    mask, by `depth` steps of walking every node up one parent at once (no per-node loop)."""
    batch, num_nodes = parents.shape
    mask = torch.eye(num_nodes, dtype=torch.bool, device=parents.device).expand(batch, -1, -1).clone()
    current = torch.arange(num_nodes, device=parents.device).expand(batch, -1)  # [B, T]
    for _ in range(depth):
        current = torch.where(current >= 0, parents.gather(1, current.clamp(min=0)), current)
        _mark(mask, current)
    return mask


def _mark(mask: torch.Tensor, ancestor: torch.Tensor) -> None:
    """mask[b, i, ancestor[b, i]] = True where ancestor >= 0."""
    hit = torch.zeros_like(mask)
    hit.scatter_(2, ancestor.clamp(min=0).unsqueeze(-1), (ancestor >= 0).unsqueeze(-1))
    mask |= hit


def sibling_ranks(parents: torch.Tensor) -> torch.Tensor:  # [B, T] int64, the root 0
    """How many earlier nodes share each node's parent: the order children are tried in."""
    num_nodes = parents.shape[1]
    same_parent = parents.unsqueeze(2) == parents.unsqueeze(1)  # [B, T, T]
    earlier = torch.ones(num_nodes, num_nodes, dtype=torch.bool, device=parents.device).tril_(-1)
    return (same_parent & earlier).sum(-1)
