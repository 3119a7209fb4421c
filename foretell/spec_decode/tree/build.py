"""Building a draft tree from per-depth draft logits (SGLang / EAGLE-2 style, batched, no host sync).

Depth 1 takes the topk tokens of the root's draft distribution. Each later depth gets the draft's
logits at the topk "frontier" nodes of the previous depth, expands topk children of each (topk *
topk candidates scored by log path probability: the parent's plus the child's log-probability) and
keeps the best topk as the next frontier. Every candidate goes into a pool; at the end the
num_draft_tokens - 1 candidates of highest path probability become the tree under the root.

The pool is ancestor-closed under that choice: a child's score is its parent's plus a log
probability <= 0, and ties are broken toward the lower pool index (a parent always sits before its
children in the pool, a better-ranked sibling before a worse one), so no node is kept without its
parent. Kept nodes are ordered by pool index, which makes them topologically ordered with siblings
best first.

A builder given `rank_logprobs` [depth, topk] (simulated acceptance, tree/simulated.py) keeps the
draft's top-k tokens but scores the rank-j child at depth d with rank_logprobs[d - 1, j] instead of
its draft log-probability: the tree takes the shape a draft calibrated to those rates would give.

The drafter drives the loop: TreeBuilder.frontier tells it which tokens to run next and which node
of the previous frontier each came from (its hidden state / KV parent); `build_tree` runs the
loop for a drafter given as a function.
"""

from __future__ import annotations

from typing import Callable

import torch

from foretell.spec_decode.tree.shape import DraftTree, TreeShape, ancestor_mask_from_parents


class TreeBuilder:
    def __init__(self, shape: TreeShape, root_tokens: torch.Tensor,  # root_tokens: [B] int64
                 rank_logprobs: torch.Tensor | None = None):  # [depth, topk] float32: scores by rank
        if rank_logprobs is not None and tuple(rank_logprobs.shape) != (shape.depth, shape.topk):
            raise ValueError(f"rank_logprobs must be [depth, topk] = [{shape.depth}, {shape.topk}], "
                             f"got {tuple(rank_logprobs.shape)}")
        self.shape = shape
        self.rank_logprobs = rank_logprobs
        self.root_tokens = root_tokens
        self.batch = root_tokens.shape[0]
        self.depth_done = 0
        # The pool, one entry per depth: tokens, scores, parents' pool indices (-1: the root).
        self._tokens: list[torch.Tensor] = []  # each [B, n_d] int64
        self._scores: list[torch.Tensor] = []  # each [B, n_d] float32
        self._parents: list[torch.Tensor] = []  # each [B, n_d] int64
        self._depths: list[int] = []
        self._pool_used = 0
        self.frontier_pool_index: torch.Tensor | None = None  # [B, topk] int64
        self.frontier_scores: torch.Tensor | None = None  # [B, topk] float32
        self.frontier_tokens: torch.Tensor | None = None  # [B, topk] int64
        self.frontier_parent_slot: torch.Tensor | None = None  # [B, topk] int64

    def add_depth(
        self, draft_logits: torch.Tensor  # [B, V] at depth 1 (the root's), [B, topk, V] below
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step's logits -> the new frontier: (tokens [B, topk], parent_slot [B, topk]),
        parent_slot the row of the previous frontier (of the logits given) each node came from."""
        topk, depth = self.shape.topk, self.depth_done + 1
        if depth > self.shape.depth:
            raise ValueError(f"the tree is already {self.shape.depth} deep (num_speculative_tokens)")
        if depth == 1:
            if draft_logits.dim() == 3 and draft_logits.shape[1] == 1:
                draft_logits = draft_logits[:, 0]
            _check_logits(draft_logits, (self.batch,), topk, "the root's draft logits")
            logprobs = torch.log_softmax(draft_logits.float(), dim=-1)  # [B, V]
            scores, tokens = logprobs.topk(topk, dim=-1, sorted=True)  # [B, topk] each
            if self.rank_logprobs is not None:
                scores = self.rank_logprobs[0].to(scores.device).expand(self.batch, -1)
            parents = torch.full_like(tokens, -1)
            self._append(tokens, scores, parents, depth)
            self.frontier_pool_index = torch.arange(topk, device=tokens.device).expand(self.batch, -1)
            self.frontier_scores, self.frontier_tokens = scores, tokens
            self.frontier_parent_slot = torch.zeros_like(tokens)
        else:
            _check_logits(draft_logits, (self.batch, topk), topk, f"the depth-{depth} draft logits")
            logprobs = torch.log_softmax(draft_logits.float(), dim=-1)  # [B, topk, V]
            child_logprobs, child_tokens = logprobs.topk(topk, dim=-1, sorted=True)  # [B, topk, topk]
            if self.rank_logprobs is not None:
                child_logprobs = self.rank_logprobs[depth - 1].to(child_logprobs.device).expand(self.batch, topk, -1)
            scores = (self.frontier_scores.unsqueeze(-1) + child_logprobs).flatten(1)  # [B, topk * topk]
            tokens = child_tokens.flatten(1)
            parents = self.frontier_pool_index.unsqueeze(-1).expand(-1, -1, topk).flatten(1)
            offset = self._append(tokens, scores, parents, depth)
            # The best topk candidates, ties to the lower index (the better-ranked expansion).
            order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]  # [B, topk]
            self.frontier_pool_index = offset + order
            self.frontier_scores = scores.gather(1, order)
            self.frontier_tokens = tokens.gather(1, order)
            self.frontier_parent_slot = order // topk
        self.depth_done = depth
        return self.frontier_tokens, self.frontier_parent_slot

    def _append(self, tokens, scores, parents, depth) -> int:
        offset = self._pool_used
        self._tokens.append(tokens)
        self._scores.append(scores)
        self._parents.append(parents)
        self._depths.append(depth)
        self._pool_used += tokens.shape[1]
        return offset

    def finish(self) -> DraftTree:
        """The num_draft_tokens - 1 best candidates under the root, as a DraftTree."""
        if self.depth_done != self.shape.depth:
            raise ValueError(f"the tree has {self.depth_done} of its {self.shape.depth} depths drafted")
        device = self.root_tokens.device
        tokens = torch.cat(self._tokens, 1)  # [B, P]
        scores = torch.cat(self._scores, 1)
        parents = torch.cat(self._parents, 1)
        depths = torch.cat([torch.full((self.batch, t.shape[1]), d, dtype=torch.int64, device=device)
                            for t, d in zip(self._tokens, self._depths)], 1)
        keep = self.shape.num_draft_tokens - 1
        chosen = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :keep]
        chosen = chosen.sort(dim=-1).values  # [B, keep] pool indices, topological order
        # pool index -> tree index (1 + rank among the kept), the root's -1 -> 0
        tree_index = torch.full((self.batch, tokens.shape[1] + 1), -1, dtype=torch.int64, device=device)
        ranks = torch.arange(1, keep + 1, device=device).expand(self.batch, -1)
        tree_index.scatter_(1, chosen, ranks)
        tree_index[:, -1] = 0  # pool parent -1 reads the last column: the root
        kept_parents = parents.gather(1, chosen)
        tree_parents = tree_index.gather(1, torch.where(kept_parents < 0, tokens.shape[1], kept_parents))
        root = torch.zeros(self.batch, 1, dtype=torch.int64, device=device)
        all_parents = torch.cat([root - 1, tree_parents], 1)  # [B, T]
        return DraftTree(
            shape=self.shape,
            tokens=torch.cat([self.root_tokens.view(-1, 1).to(torch.int64), tokens.gather(1, chosen)], 1),
            parents=all_parents,
            depths=torch.cat([root, depths.gather(1, chosen)], 1),
            ancestor_mask=ancestor_mask_from_parents(all_parents, self.shape.depth),
            scores=torch.cat([root.float(), scores.gather(1, chosen)], 1),
        )


DraftStep = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def build_tree(shape: TreeShape, root_tokens: torch.Tensor, root_draft_logits: torch.Tensor,
               draft_step: DraftStep, rank_logprobs: torch.Tensor | None = None) -> DraftTree:
    """Run the draft loop: draft_step(frontier_tokens [B, topk], parent_slot [B, topk], depth)
    returns the draft logits [B, topk, V] after each frontier node (depth = the frontier's)."""
    builder = TreeBuilder(shape, root_tokens, rank_logprobs)
    frontier, parent_slot = builder.add_depth(root_draft_logits)
    for depth in range(1, shape.depth):
        frontier, parent_slot = builder.add_depth(draft_step(frontier, parent_slot, depth))
    return builder.finish()


def _check_logits(logits: torch.Tensor, leading: tuple[int, ...], topk: int, what: str) -> None:
    if tuple(logits.shape[:-1]) != leading or logits.dim() != len(leading) + 1:
        raise ValueError(f"{what} must be [{', '.join(map(str, leading))}, vocab], got {tuple(logits.shape)}")
    if logits.shape[-1] < topk:
        raise ValueError(f"topk={topk} exceeds the draft vocabulary ({logits.shape[-1]} tokens)")
