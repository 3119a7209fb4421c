"""Simulated acceptance for draft trees: benchmarks at real sizes with random weights.

speculative_config {"topk": > 1, "simulate_acceptance": {"rates": [r_1, ..., r_depth]} or
{"mean_acceptance_length": L}} (rates as for chains, spec_decode/simulated_acceptance.py, one per
depth: num_speculative_tokens). Only the accept decision is drawn: P(accepted >= d) = r_d, a step's
count being the number of rates above its uniform (SimulatedAcceptance's low-discrepancy draws).
A tree's accepted path is its best path, from the root through each node's first (best-ranked)
child, cut at the drawn count or where that path ends in the tree. The token after the path is the
target's argmax at its last node, so the output is the drafted path then a target token, synthetic
text, as for the chain's simulated mode.

With random weights the draft's distributions are nearly flat, so a tree kept by path probability
would be wide and shallow and could not hold the best path the rates ask for. Under simulation the
drafter therefore scores its top-k children by rank (`rank_logprobs`): the rank-0 child scores
log 1, so the best path is always kept whole (num_draft_tokens allowing), and the other ranks at
depth d share 1 - r_d / r_{d-1} (what a calibrated draft leaves beside its best guess, the
conditional rate), halving by rank; they fill the rest of the tree. The tree's tokens are still
the draft's top-k, its forwards and verify rows are those of a real step; only its shape is set.
"""

from __future__ import annotations

import torch

from foretell.spec_decode.tree.shape import DraftTree, TreeShape, sibling_ranks
from foretell.spec_decode.tree.path_verify import best_path_nodes, last_on_path, result_from_on_path
from foretell.spec_decode.tree.verify import TreeVerifyResult, first_child_where, walk_down

SMALLEST_RATE = 1e-6  # log of a zero rate would be -inf: ties among the kept nodes' scores


def best_path(tree: DraftTree) -> torch.Tensor:  # [B, depth + 1] node indices from the root, -1 past its end
    """The walk (verify.walk_down) down each node's best-ranked child: the twin of path_verify.best_path_nodes."""
    first_children = (sibling_ranks(tree.parents) == 0) & (tree.parents >= 0)
    return walk_down(tree, first_child_where(tree, first_children))


def rank_logprobs(shape: TreeShape, rates: list[float]) -> torch.Tensor:  # [depth, topk] float32
    """Children's scores by rank for simulated acceptance at `rates` (non-increasing, one per
    depth): 0 for the best-ranked child, the complement of the conditional rate for the others."""
    if len(rates) != shape.depth:
        raise ValueError(f"simulated rates must be one per depth ({shape.depth}), got {len(rates)}")
    out = torch.zeros(shape.depth, shape.topk, dtype=torch.float64)
    shares = torch.tensor([0.5**j for j in range(1, shape.topk)], dtype=torch.float64)
    previous = 1.0
    for d, rate in enumerate(rates):
        conditional = rate / previous if previous > 0 else 0.0
        previous = rate
        rest = min(max(1.0 - conditional, SMALLEST_RATE), 1.0 - SMALLEST_RATE)
        out[d, 1:] = (rest * shares / shares.sum().clamp(min=SMALLEST_RATE)).log()
    return out.float()


def simulated_tree_accept(
    tree: DraftTree,
    uniforms: torch.Tensor,  # [B] in [0, 1), one per sequence (SimulatedAcceptance draws them)
    rates: torch.Tensor,  # [depth] non-increasing in [0, 1]
    bonus_tokens: torch.Tensor,  # [B] int64, or [B, T] the target's argmax at every node (read at the path's end)
    accept_limits: torch.Tensor | None = None,  # [B] int64: at most this many accepted (near max_tokens)
) -> TreeVerifyResult:
    depth = tree.shape.depth
    if rates.shape != (depth,):
        raise ValueError(f"simulated rates must be one per depth ({depth}), got shape {tuple(rates.shape)}")
    drawn = (rates.unsqueeze(0) > uniforms.unsqueeze(1).to(rates.dtype)).sum(1)  # [B]
    if accept_limits is not None:
        drawn = torch.minimum(drawn, accept_limits.to(drawn.device))
    on_path = best_path_nodes(tree, drawn)  # [B, T]
    if bonus_tokens.dim() == 2:
        bonus_tokens = bonus_tokens.gather(1, last_on_path(tree, on_path).unsqueeze(1)).squeeze(1)
    return result_from_on_path(tree, on_path, bonus_tokens)
