"""Simulated acceptance for draft trees: benchmarks at real sizes with random weights.

As for chains (spec_decode/simulated_acceptance.py), only the accept decision is drawn: rates
r_1 >= ... >= r_depth give P(accepted >= d) = r_d, a step's count being the number of rates above
its uniform. A tree's accepted path is its best path, from the root through each node's first
(best-ranked) child, cut at the drawn count or where that path ends in the tree (a tree trimmed by
num_draft_tokens may hold a shorter best path than its depth). The bonus token is the caller's
(the target's argmax at the last accepted node, say).
"""

from __future__ import annotations

import torch

from foretell.spec_decode.tree.shape import DraftTree, sibling_ranks
from foretell.spec_decode.tree.verify import TreeVerifyResult, first_child_where, result_from_path, walk_down


def best_path(tree: DraftTree) -> torch.Tensor:  # [B, depth + 1] node indices from the root, -1 past its end
    first_children = (sibling_ranks(tree.parents) == 0) & (tree.parents >= 0)
    return walk_down(tree, first_child_where(tree, first_children))


def simulated_tree_accept(
    tree: DraftTree,
    uniforms: torch.Tensor,  # [B] in [0, 1), one per sequence (SimulatedAcceptance draws them)
    rates: torch.Tensor,  # [depth] non-increasing in [0, 1]
    bonus_tokens: torch.Tensor,  # [B] int64
) -> TreeVerifyResult:
    depth = tree.shape.depth
    if rates.shape != (depth,):
        raise ValueError(f"simulated rates must be one per depth ({depth}), got shape {tuple(rates.shape)}")
    drawn = (rates.unsqueeze(0) > uniforms.unsqueeze(1).to(rates.dtype)).sum(1)  # [B]
    path = best_path(tree)
    keep = torch.arange(depth + 1, device=path.device).unsqueeze(0) <= drawn.unsqueeze(1)
    return result_from_path(tree, torch.where(keep, path, -1), bonus_tokens)
