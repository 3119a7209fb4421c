"""Verifying a batch of draft trees in a fixed handful of device ops, whatever the depth (issue 28).

verify.py walks each tree down one level at a time (a gather and a few selects per depth, the
reference kept as the twin these functions are tested against). Here every node is decided at
once from the tree's ancestor mask instead:

  chosen[b, t]   node t is the child its parent moves to: greedy, its token equals the target's
                 argmax at its parent's row (siblings' tokens are distinct, so at most one per
                 parent); sampled, it is the first sibling whose uniform fell under its acceptance
                 probability; simulated, it is its parent's best-ranked child. The root: always.
  on_path[b, t]  node t and every ancestor of it are chosen (ancestor_mask: no unchosen node among
                 them), cut at the accept limit's depth. These nodes form one chain from the root:
                 one node per depth, from 0 to the accepted count.

The path's node indices, the emitted tokens and the last node (whose row gives the bonus token)
are scatters and a max over on_path, so a verify issues the same ~25 launches at depth 2 or 10 and
the host reads its result once (the runner's packed read). Same results as verify.py, bit for bit
(tests/spec_decode/tree/test_tree_path_verify.py).
"""

from __future__ import annotations

import torch

from foretell.spec_decode.tree.shape import DraftTree
from foretell.spec_decode.tree.verify import TreeVerifyResult, _check_rows, node_acceptance


def verify_greedy_paths(
    tree: DraftTree,
    target_ids: torch.Tensor,  # [B, T] int64: the target's argmax at every node's row
    accept_limits: torch.Tensor | None = None,  # [B] int64: at most this many accepted (near max_tokens)
) -> TreeVerifyResult:
    """verify.verify_greedy (then cut at accept_limits) in depth-independent tensor ops."""
    _check_rows(tree, target_ids)
    matches = (tree.tokens == target_ids.gather(1, tree.parents.clamp(min=0))) & (tree.parents >= 0)  # [B, T]
    on_path = path_nodes(tree, first_among_siblings(tree, matches), accept_limits)
    last = last_on_path(tree, on_path)
    return result_from_on_path(tree, on_path, target_ids.gather(1, last.unsqueeze(1)).squeeze(1))


def verify_sampled_paths(
    tree: DraftTree,
    target_probs: torch.Tensor,  # [B, T, V] after temperature / top-k / top-p
    uniforms: torch.Tensor,  # [B, T] in [0, 1): one per node (the root's unused)
    noise: torch.Tensor,  # [B, V] Exp(1) draws: the bonus token's exponential race
    draft_probs: torch.Tensor | None = None,  # [B, T, V] or None (deterministic top-k drafts)
) -> TreeVerifyResult:
    """verify.verify_sampled with its draws given (the same draws give the same result)."""
    if uniforms.shape != tree.tokens.shape:
        raise ValueError(f"uniforms {tuple(uniforms.shape)} must be one per node, {tuple(tree.tokens.shape)}")
    if noise.shape != (target_probs.shape[0], target_probs.shape[-1]):
        raise ValueError(f"noise {tuple(noise.shape)} must be [B, V] = "
                         f"{(target_probs.shape[0], target_probs.shape[-1])}")
    accept, residual = node_acceptance(tree, target_probs, draft_probs)
    accepted = (uniforms.to(accept.dtype) < accept) & (tree.parents >= 0)  # [B, T]
    on_path = path_nodes(tree, first_among_siblings(tree, accepted))
    last = last_on_path(tree, on_path)
    final = residual.gather(1, last.view(-1, 1, 1).expand(-1, 1, residual.shape[-1])).squeeze(1)  # [B, V]
    bonus = (final / noise.to(final.dtype)).argmax(-1)  # token v wins with probability final[v]
    return result_from_on_path(tree, on_path, bonus)


def best_path_nodes(tree: DraftTree, num_accepted: torch.Tensor) -> torch.Tensor:  # [B, T] bool
    """on_path [B, T] of each tree's best path (every node its parent's best-ranked child, i.e. the
    lowest-indexed one), cut at num_accepted [B] nodes below the root: simulated acceptance."""
    num_nodes = tree.num_nodes
    index = torch.arange(num_nodes, device=tree.parents.device)  # [T]
    first = torch.full((tree.parents.shape[0], num_nodes + 1), num_nodes, dtype=torch.int64,
                       device=tree.parents.device)
    first.scatter_reduce_(1, torch.where(tree.parents >= 0, tree.parents, num_nodes), index.expand_as(tree.parents),
                          reduce="amin")  # [B, T + 1]: each node's first child (T: none)
    chosen = (first.gather(1, tree.parents.clamp(min=0)) == index) | (tree.parents < 0)
    return path_nodes(tree, chosen, num_accepted)


def first_among_siblings(tree: DraftTree, flags: torch.Tensor) -> torch.Tensor:  # [B, T] bool
    """Flagged children with no flagged earlier sibling (the one a walk would step to), and the root.
    (Greedy: a drafted tree's siblings are distinct tokens, so at most one matches anyway.)"""
    num_nodes = tree.num_nodes
    earlier = torch.ones(num_nodes, num_nodes, dtype=torch.bool, device=flags.device).tril_(-1)  # [T, T]
    same_parent = tree.parents.unsqueeze(2) == tree.parents.unsqueeze(1)  # [B, T, T]
    beaten = (same_parent & earlier & flags.unsqueeze(1)).any(-1)  # [B, T]
    return (flags & ~beaten) | (tree.parents < 0)


def path_nodes(tree: DraftTree, chosen: torch.Tensor, accept_limits: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] bool: nodes whose ancestors and themselves are all chosen (and at most accept_limits deep)."""
    on_path = ~(tree.ancestor_mask & ~chosen.unsqueeze(1)).any(-1)  # [B, T]
    if accept_limits is not None:
        on_path &= tree.depths <= accept_limits.to(tree.depths.device).unsqueeze(1)
    return on_path


def last_on_path(tree: DraftTree, on_path: torch.Tensor) -> torch.Tensor:  # [B] int64
    """The deepest node on the path (the root when nothing is accepted)."""
    return torch.where(on_path, tree.depths, -1).argmax(1)


def result_from_on_path(tree: DraftTree, on_path: torch.Tensor, bonus: torch.Tensor) -> TreeVerifyResult:
    """The path's node indices by depth, its drafts then the bonus token: scatters over on_path."""
    batch, num_nodes = on_path.shape
    depth = tree.shape.depth
    device = on_path.device
    # Nodes off the path (and, for the tokens, the root) land in a spare last column, dropped.
    spare = depth + 1
    path = torch.full((batch, depth + 2), -1, dtype=torch.int64, device=device)
    path.scatter_(1, torch.where(on_path, tree.depths, spare),
                  torch.arange(num_nodes, device=device).expand(batch, -1))
    path = path[:, : depth + 1]
    num_accepted = on_path.sum(1) - 1  # [B]
    outputs = torch.full((batch, depth + 2), -1, dtype=torch.int64, device=device)
    outputs.scatter_(1, torch.where(on_path & (tree.depths > 0), tree.depths - 1, spare), tree.tokens)
    outputs.scatter_(1, num_accepted.unsqueeze(1), bonus.unsqueeze(1))
    return TreeVerifyResult(path, num_accepted, bonus, outputs[:, : depth + 1])
