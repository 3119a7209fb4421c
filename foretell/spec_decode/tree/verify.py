"""Verifying a draft tree against the target: greedy longest matching path, and multi-draft
rejection sampling (SpecInfer, Miao et al. 2024; SGLang's tree sampling). Batched, no host sync.

Row t of the target's probabilities is its next-token distribution after node t's path (the verify
forward's output at node t). Greedy: from the root, step to the child whose token equals the
target's argmax at the current node (siblings' tokens are distinct, so at most one); stop where
none does; the bonus token is the argmax at the last node reached.

Sampled: at node n with children c_1, c_2, ... (best first), keep a residual r = p_n; try c_j:
accept with probability min(1, r(x_j) / q_j(x_j)), x_j its token and q_j the distribution it was
drawn from (a one-hot at x_j for a deterministic top-k draft); on rejection r <- max(0, r - q_j)
normalised and try the next. If a child is accepted, continue at it; if none is, emit a token
drawn from the final r and stop (a leaf's r is p itself). When the children's tokens are drawn
independently from their q_j (or are fixed: one-hot q), the emitted tokens follow the target's
distribution exactly.

The per-node acceptance probabilities (given the earlier siblings were rejected) and final
residuals are computed for every node at once (`node_acceptance`), then one uniform per node
decides, and the walk goes down `depth` levels with tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foretell.spec_decode.tree.shape import DraftTree, sibling_ranks


@dataclass
class TreeVerifyResult:
    accepted_nodes: torch.Tensor  # [B, depth + 1] int64: the path's node indices from the root, -1 past its end
    num_accepted: torch.Tensor  # [B] int64: draft tokens accepted (the path's length below the root)
    bonus_tokens: torch.Tensor  # [B] int64: the target's token after the accepted path
    output_tokens: torch.Tensor  # [B, depth + 1] int64: accepted drafts then the bonus token, -1 after

    def accepted_per_depth(self) -> torch.Tensor:  # [depth] int64: sequences that accepted depth d + 1
        depth = self.accepted_nodes.shape[1] - 1
        return (self.num_accepted.unsqueeze(1) > torch.arange(depth, device=self.num_accepted.device)).sum(0)


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> TreeVerifyResult:
    """target_logits: [B, T, V] (or [B, T] argmax ids already taken)."""
    _check_rows(tree, target_logits)
    target_ids = target_logits if target_logits.dim() == 2 else target_logits.argmax(-1)  # [B, T]
    parents = tree.parents.clamp(min=0)
    matches = tree.tokens == target_ids.gather(1, parents)  # [B, T]
    matches[:, 0] = False
    path = walk_down(tree, first_child_where(tree, matches))
    last = last_node(path)
    return result_from_path(tree, path, target_ids.gather(1, last.unsqueeze(1)).squeeze(1))


def node_acceptance(
    tree: DraftTree,
    target_probs: torch.Tensor,  # [B, T, V], each row a distribution
    draft_probs: torch.Tensor | None = None,  # [B, T, V]: row t the distribution node t was drawn from; None: one-hot
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accept [B, T]: each non-root node's acceptance probability given its earlier siblings were
    rejected, residual [B, T, V]: each node's distribution to draw from when all its children are
    rejected (p itself at a leaf))."""
    _check_rows(tree, target_probs)
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)} must match target_probs {tuple(target_probs.shape)}")
    batch, num_nodes, vocab = target_probs.shape
    residual = target_probs.clone()
    accept = torch.zeros(batch, num_nodes, dtype=target_probs.dtype, device=target_probs.device)
    ranks = sibling_ranks(tree.parents)  # [B, T]
    is_child = tree.parents >= 0
    parents = tree.parents.clamp(min=0)
    tokens = tree.tokens.unsqueeze(-1)  # [B, T, 1]
    if draft_probs is None:
        q_token = torch.ones(batch, num_nodes, dtype=target_probs.dtype, device=target_probs.device)
    else:
        q_token = draft_probs.gather(2, tokens).squeeze(-1)  # [B, T]
    for rank in range(tree.shape.topk):
        trying = is_child & (ranks == rank)  # [B, T]: the children tried at this round
        p_token = residual.gather(1, parents.unsqueeze(-1).expand(-1, -1, vocab)).gather(2, tokens).squeeze(-1)
        ratio = torch.where(q_token > 0, (p_token / q_token.clamp(min=torch.finfo(q_token.dtype).tiny)).clamp(max=1),
                            (p_token > 0).to(p_token.dtype))
        accept = torch.where(trying, ratio, accept)
        # Each node's rank-`rank` child (if any) takes its q out of the node's residual.
        child_of = torch.full((batch, num_nodes + 1), num_nodes, dtype=torch.int64, device=tree.tokens.device)
        child_of.scatter_(1, torch.where(trying, parents, num_nodes),
                          torch.arange(num_nodes, device=tree.tokens.device).expand(batch, -1))
        child = child_of[:, :num_nodes]  # [B, T]: node n's child at this rank, T if none
        has_child = child < num_nodes
        if draft_probs is None:
            taken = torch.zeros_like(residual).scatter_(
                2, tree.tokens.gather(1, child.clamp(max=num_nodes - 1)).unsqueeze(-1), 1.0)
        else:
            taken = draft_probs.gather(1, child.clamp(max=num_nodes - 1).unsqueeze(-1).expand(-1, -1, vocab))
        reduced = (residual - taken).clamp_(min=0)
        total = reduced.sum(-1, keepdim=True)
        # A zero residual only follows a rejection that had probability 0; keep p there.
        reduced = torch.where(total > 0, reduced / total.clamp(min=torch.finfo(total.dtype).tiny), residual)
        residual = torch.where(has_child.unsqueeze(-1), reduced, residual)
    return accept, residual


def verify_sampled(
    tree: DraftTree,
    target_probs: torch.Tensor,  # [B, T, V] after temperature / top-k / top-p
    draft_probs: torch.Tensor | None = None,  # [B, T, V] or None (deterministic top-k drafts)
    generator: torch.Generator | None = None,
) -> TreeVerifyResult:
    accept, residual = node_acceptance(tree, target_probs, draft_probs)
    uniforms = torch.rand(accept.shape, generator=generator, device=accept.device, dtype=accept.dtype)
    accepted = (uniforms < accept) & (tree.parents >= 0)
    path = walk_down(tree, first_child_where(tree, accepted))
    last = last_node(path)
    final = residual.gather(1, last.view(-1, 1, 1).expand(-1, 1, residual.shape[-1])).squeeze(1)  # [B, V]
    noise = torch.empty_like(final).exponential_(generator=generator)
    bonus = (final / noise).argmax(-1)  # an exponential race: token v wins with probability final[v]
    return result_from_path(tree, path, bonus)


def first_child_where(tree: DraftTree, flags: torch.Tensor) -> torch.Tensor:  # [B, T]
    """For each node, its first child (in sibling order, i.e. by index) whose flag is set; T if none."""
    batch, num_nodes = flags.shape
    candidate = torch.where(flags, torch.arange(num_nodes, device=flags.device).expand(batch, -1), num_nodes)
    first = torch.full((batch, num_nodes + 1), num_nodes, dtype=torch.int64, device=flags.device)
    first.scatter_reduce_(1, torch.where(flags, tree.parents.clamp(min=0), num_nodes), candidate, reduce="amin")
    return first[:, :num_nodes]


def walk_down(tree: DraftTree, next_node: torch.Tensor) -> torch.Tensor:  # [B, depth + 1]
    batch, num_nodes = next_node.shape
    node = torch.zeros(batch, dtype=torch.int64, device=next_node.device)
    alive = torch.ones(batch, dtype=torch.bool, device=next_node.device)
    path = [node]
    for _ in range(tree.shape.depth):
        step = next_node.gather(1, node.unsqueeze(1)).squeeze(1)
        alive = alive & (step < num_nodes)
        node = torch.where(alive, step, node)
        path.append(torch.where(alive, step, -1))
    return torch.stack(path, 1)


def last_node(path: torch.Tensor) -> torch.Tensor:  # [B]
    length = (path >= 0).sum(1)
    return path.gather(1, (length - 1).unsqueeze(1)).squeeze(1)


def result_from_path(tree: DraftTree, path: torch.Tensor, bonus: torch.Tensor) -> TreeVerifyResult:
    num_accepted = (path >= 0).sum(1) - 1
    drafts = torch.where(path >= 0, tree.tokens.gather(1, path.clamp(min=0)), -1)  # [B, depth + 1]
    # Shift the accepted drafts left over the root and put the bonus after them.
    outputs = torch.cat([drafts[:, 1:], torch.full_like(drafts[:, :1], -1)], 1)
    outputs.scatter_(1, num_accepted.unsqueeze(1), bonus.unsqueeze(1))
    return TreeVerifyResult(path, num_accepted, bonus, outputs)


def _check_rows(tree: DraftTree, target: torch.Tensor) -> None:
    if tuple(target.shape[:2]) != tuple(tree.tokens.shape):
        raise ValueError(
            f"the target's rows {tuple(target.shape)} must be [B, T, ...] = {tuple(tree.tokens.shape)}: "
            "one row per tree node"
        )
