"""Drafting a tree with an EAGLE3 head (issue 28): the catch-up, then depth-by-depth expansion.

The catch-up is the chain's (Eagle3Proposer.catch_up over the accepted rows): its last row's draft
logits give depth 1 (the topk tokens after the root, the sequence's next token). Each later depth
runs the head over the frontier nodes kept so far, topk per depth, fed their own token and their
parent's h (EAGLE3's state: the catch-up's last row for depth-1 nodes), at row position
root position + depth - 1 (EAGLE3 rows pair features at t with the token at t + 1).

The frontier rows' keys and values go to scratch slots of the draft cache, right after the
sequence's verified tokens: depth d's topk rows at slots root position + (d - 1) * topk + j. The
forward at depth d runs only that depth's topk new rows per sequence; the earlier frontier rows'
K/V are already cached at the (d - 1) * topk slots just before them, so each new row reaches its
ancestors through the tree mask's columns, which address the sequence's last d * topk keys
(ops/attention: a [topk, d * topk] ancestor mask per sequence, the verified context seen whole).
None of the scratch survives the step: the next catch-up writes the accepted path's draft KV in
place (the rows of the path, from the target's verify), so the draft cache never needs compaction.

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
        expansions = self.shape.depth - 1
        # Every depth's scratch rows and positions, built once: depth d's slice per forward.
        scratch = catch_up_metadata(roots, [expansions * topk] * n, table, batch.block_size, eagle.draft_block_size)
        slots = scratch.slot_mapping.view(n, expansions, topk)  # [n, depth - 1, topk]
        all_positions = to_device([[min(r + d, last_position) for r in roots for _ in range(topk)]
                                   for d in range(1, expansions + 1)], torch.int64, device)  # [depth - 1, n * topk]
        row_starts = [i * topk for i in range(n + 1)]
        row_starts_device = to_device(row_starts, torch.int32, device)
        roots_device = to_device(roots, torch.int32, device)
        parent_h = h.unsqueeze(1).expand(n, topk, h.shape[-1])  # depth-1 rows: the root's h
        eye = torch.eye(topk, dtype=torch.bool, device=device).expand(n, topk, topk)
        mask = eye  # [n, topk, d * topk]: the newest frontier rows' ancestors (and themselves) so far
        for depth in range(1, expansions + 1):
            tokens = eagle.to_target_ids(frontier).flatten()  # [n * topk]
            states = parent_h.gather(1, parent_slot.unsqueeze(-1).expand(-1, -1, parent_h.shape[-1]))  # [n, topk, H]
            if depth > 1:  # a row sees what its parent sees, and itself
                mask = torch.cat([mask.gather(1, parent_slot.unsqueeze(-1).expand(-1, -1, mask.shape[-1])), eye], 2)
            width = depth * topk  # the frontier rows so far: this depth's are the last topk of them
            metadata = replace(
                scratch, query_start_loc=row_starts_device, seq_lens=roots_device + width,
                slot_mapping=slots[:, depth - 1].flatten(), max_query_len=topk, max_seq_len=max(roots) + width,
                query_start_loc_cpu=row_starts, seq_lens_cpu=[r + width for r in roots],
                tree_mask=mask.reshape(n * topk, width),
            )
            out, new_h = eagle.head.step(
                tokens, all_positions[depth - 1], states.flatten(0, 1), metadata,
            )  # [n * topk, draft_vocab], [n * topk, H]
            frontier, parent_slot = builder.add_depth(out.view(n, topk, -1))
            parent_h = new_h.view(n, topk, -1)
        tree = builder.finish()
        nodes = eagle.to_target_ids(tree.tokens[:, 1:])
        tree.tokens = torch.cat([tree.tokens[:, :1], nodes], 1)
        return tree
