"""Drafting a tree with an EAGLE3 head (issue 28): the catch-up, then depth-by-depth expansion.

The catch-up is the chain's (Eagle3Proposer.catch_up over the accepted rows): its last row's draft
logits give depth 1 (the topk tokens after the root, the sequence's next token). Each later depth
runs the head over the frontier nodes kept so far, topk per depth, fed their own token and their
parent's h (EAGLE3's state: the catch-up's last row for depth-1 nodes), at row position
root position + depth - 1 (EAGLE3 rows pair features at t with the token at t + 1).

The frontier rows' keys and values go to scratch slots of the draft cache, right after the
sequence's verified tokens: depth d's topk rows at slots root position + (d - 1) * topk + j. The
tree attention mask of ops/attention applies to a forward's new rows, so the forward at depth d
runs every frontier row so far (d * topk per sequence: the earlier ones again, as EAGLE re-runs
its tree) with their ancestor mask, and keeps the outputs of the newest topk rows. None of the
scratch survives the step: the next catch-up writes the accepted path's draft KV in place (the
rows of the path, from the target's verify), so the draft cache never needs compaction.

Trees are drafted from the head's plain logits for greedy and sampled requests alike (top-k
drafts are deterministic: verify_sampled takes them with one-hot q). The runner keeps the
returned tree per sequence until its verify (runner/tree_step.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from foretell.device_util import to_device
from foretell.spec_decode.proposer import DraftBatch, catch_up_metadata
from foretell.spec_decode.tree.build import TreeBuilder
from foretell.spec_decode.tree.shape import DraftTree, TreeShape


class Eagle3TreeDrafter:
    def __init__(self, eagle, shape: TreeShape, rank_logprobs: torch.Tensor | None = None):
        self.eagle = eagle  # a loaded Eagle3Proposer
        self.shape = shape
        self.rank_logprobs = rank_logprobs  # [depth, topk]: simulated acceptance's tree shape (tree/simulated.py)

    def draft(self, batch: DraftBatch, drafting: list[int]) -> DraftTree | None:
        """Catch up every sequence of the batch; draft a tree for the sequences `drafting` names
        (indices into the batch). Returns their trees [len(drafting), num_draft_tokens] in target
        ids, or None when none drafts."""
        eagle, topk = self.eagle, self.shape.topk
        logits, h = eagle.catch_up(batch, drafting)  # [n, draft_vocab] float32, [n, H]
        if not drafting:
            return None
        n = len(drafting)
        device = h.device
        root_tokens = to_device([batch.next_token_ids[i] for i in drafting], torch.int64, device)
        builder = TreeBuilder(self.shape, root_tokens, self.rank_logprobs)
        frontier, parent_slot = builder.add_depth(logits)  # draft ids [n, topk], [n, topk]
        # Row positions: the root sits at num_tokens_after_step - 1; a depth-d node's row at root + d - 1.
        roots = [batch.num_tokens_after_step(i) - 1 for i in drafting]
        last_position = batch.max_model_len - 1
        table = batch.block_table[to_device(drafting, torch.int64, device)]
        tokens: list[torch.Tensor] = []  # per depth: [n, topk] target ids of the frontier rows
        states: list[torch.Tensor] = []  # per depth: [n, topk, H] each row's g (its parent's h)
        parent_h = h.unsqueeze(1).expand(n, topk, h.shape[-1])  # depth-1 rows: the root's h
        mask = torch.eye(topk, dtype=torch.bool, device=device).expand(n, topk, topk)  # [n, W, W]
        for depth in range(1, self.shape.depth):
            tokens.append(eagle.to_target_ids(frontier))
            states.append(parent_h.gather(1, parent_slot.unsqueeze(-1).expand(-1, -1, parent_h.shape[-1])))
            if depth > 1:
                mask = _grow_mask(mask, parent_slot, topk)
            width = depth * topk
            positions = [min(r + d, last_position) for r in roots for d in range(1, depth + 1) for _ in range(topk)]
            metadata = catch_up_metadata(roots, [width] * n, table, batch.block_size, eagle.draft_block_size)
            metadata = replace(metadata, tree_mask=mask.reshape(n * width, width))
            keep = (torch.arange(n, device=device).unsqueeze(1) * width + width - topk
                    + torch.arange(topk, device=device)).flatten()  # [n * topk]: the newest rows
            out, new_h = eagle.head.step(
                torch.cat(tokens, 1).flatten(), to_device(positions, torch.int64, device),
                torch.cat(states, 1).flatten(0, 1), metadata, keep,
            )  # [n * topk, draft_vocab], [n * topk, H]
            frontier, parent_slot = builder.add_depth(out.view(n, topk, -1))
            parent_h = new_h.view(n, topk, -1)
        tree = builder.finish()
        nodes = eagle.to_target_ids(tree.tokens[:, 1:])
        tree.tokens = torch.cat([tree.tokens[:, :1], nodes], 1)
        return tree


def _grow_mask(mask: torch.Tensor, parent_slot: torch.Tensor, topk: int) -> torch.Tensor:
    """[n, W, W] ancestor mask of the frontier rows so far -> [n, W + topk, W + topk] with the
    newest depth's topk rows: each sees its parent (row W - topk + parent_slot), that row's
    ancestors, and itself."""
    n, width, _ = mask.shape
    parent_rows = (width - topk + parent_slot).unsqueeze(-1).expand(-1, -1, width)  # [n, topk, W]
    grown = torch.zeros(n, width + topk, width + topk, dtype=torch.bool, device=mask.device)
    grown[:, :width, :width] = mask
    grown[:, width:, :width] = mask.gather(1, parent_rows)
    grown[:, width:, width:] = torch.eye(topk, dtype=torch.bool, device=mask.device)
    return grown
