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

After a graphed verify the catch-up itself runs from device inputs (padded_catch_up: the accepted
path padded to depth + 1 rows, no host read). The expansion after the catch-up (depth 1 through the
last depth, and the choice of the tree) is device work only (Eagle3TreeDrafter.expand: slots,
positions, masks and the tree built on the device, no host read): the runner replays it as one
CUDA graph per batch bucket (tree/draft_graphs.py), or runs the same code eagerly.
"""

from __future__ import annotations

import torch

from foretell.device_util import to_device
from foretell.ops.attention.metadata import AttentionMetadata, subdivide_block_table
from foretell.ops.step.reference import catch_up_rows_torch
from foretell.spec_decode.proposer import DraftBatch
from foretell.spec_decode.tree.build import TreeBuilder
from foretell.spec_decode.tree.shape import DraftTree, TreeShape


class Eagle3TreeDrafter:
    def __init__(self, eagle, shape: TreeShape, rank_logprobs: torch.Tensor | None = None):
        self.eagle = eagle  # a loaded Eagle3Proposer
        self.shape = shape
        self.rank_logprobs = rank_logprobs  # [depth, topk]: simulated acceptance's tree shape (tree/simulated.py)
        self.graphs = None  # tree/draft_graphs.TreeDraftGraphs: the expansion on graphs (None: eager)

    def draft(self, batch: DraftBatch, drafting: list[int]) -> DraftTree | None:
        """Catch up every sequence of the batch; draft a tree for the sequences `drafting` names
        (indices into the batch). Returns their trees [len(drafting), num_draft_tokens] in target
        ids, or None when none drafts."""
        logits, h = self.eagle.catch_up(batch, drafting)  # [n, draft_vocab] float32, [n, H]
        if not drafting:
            return None
        root_tokens = [batch.next_token_ids[i] for i in drafting]
        # The root sits at num_tokens_after_step - 1; a depth-d node's row at root + d - 1.
        roots = [batch.num_tokens_after_step(i) - 1 for i in drafting]
        n, device = len(drafting), h.device
        every = drafting == list(range(batch.block_table.shape[0]))  # the usual case: the table as it is
        table = batch.block_table  # [n, max_blocks] int32 once only the drafting rows are kept
        if self.graphs is not None:  # the graphs upload the roots themselves
            if not every:
                table = table[to_device(drafting, torch.int64, device)]
            tree = self.graphs.run(logits, h, root_tokens, roots, table)
            if tree is not None:
                return tree
        # Eager: one upload, the root tokens, the roots, then (unless every sequence drafts, or the
        # graphs' path took them already) which table rows.
        pick = not every and table is batch.block_table
        host_ints = to_device(root_tokens + roots + (drafting if pick else []), torch.int64, device)
        if pick:
            table = table[host_ints[2 * n:]]
        return self.expand(logits, h, host_ints[:n], host_ints[n: 2 * n], table,
                           batch.block_size, batch.max_model_len - 1, roots_host=roots)

    def padded_catch_up(
        self,
        features: torch.Tensor,  # [B * (depth + 1), F]: the target's aux features (side by side) at each path row
        path_tokens: torch.Tensor,  # [B, depth + 2] int64 target ids: the verified root's token, the accepted
        #                             drafts, the bonus token, then anything (-1)
        accepted: torch.Tensor,  # [B] int64: drafts accepted (the path's rows: 0 .. accepted)
        first_pos: torch.Tensor,  # [B] int64: the verified root's position
        live: torch.Tensor,  # [B] bool: padding sequences (False) write no KV
        table: torch.Tensor,  # [B, max_blocks] int32: the target's block table (block_size)
        block_size: int,
        last_position: int,  # max_model_len - 1
        first_pos_host: list[int] | None = None,  # the roots' positions on the host, for backends that read lengths
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The catch-up after a tree verify from device inputs only (capturable: no host read, fixed
        shapes): every sequence's accepted path padded to depth + 1 rows, as the chain's padded step
        pads its verify rows (ops/step reference.catch_up_rows_torch, the one definition of a row's
        token, position and slot). Row r sits at first_pos + r; rows past the path (fed the bonus
        token) write their keys at positions the expansion's scratch rewrites before anything reads
        them (the scheduler reserves num_draft_kv_slots >= depth slots past the verify's rows), so a
        real row's output and every key a later step reads equal the unpadded catch-up's.
        Returns (logits [B, draft_vocab] float32 and h [B, H] of each path's last row, the next
        root tokens [B] (the bonus), the next roots' positions [B])."""
        eagle = self.eagle
        n, rows_per_seq = accepted.shape[0], self.shape.depth + 1
        next_token = path_tokens.gather(1, (accepted + 1).unsqueeze(1)).squeeze(1)  # [B]: the bonus
        tokens, positions, slots = catch_up_rows_torch(
            path_tokens[:, :rows_per_seq].clamp(min=0), first_pos, accepted, next_token, live, table, block_size,
            rows_per_seq, -eagle.row_offset, last_position)  # each [B, depth + 1]
        device = accepted.device
        seq_lens = (first_pos + rows_per_seq).clamp(max=last_position + 1).to(torch.int32)  # [B]
        seq_lens_cpu = ([min(p + rows_per_seq, last_position + 1) for p in first_pos_host]
                        if first_pos_host is not None else [rows_per_seq] * n)
        metadata = AttentionMetadata(
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device) * rows_per_seq,
            seq_lens=seq_lens, block_table=table, slot_mapping=slots.flatten(), block_size=block_size,
            max_query_len=rows_per_seq,
            max_seq_len=max(seq_lens_cpu) if first_pos_host is not None else last_position + 1,
            query_start_loc_cpu=[i * rows_per_seq for i in range(n + 1)], seq_lens_cpu=seq_lens_cpu,
        ).with_block_size(eagle.draft_block_size)
        keep_rows = torch.arange(n, device=device) * rows_per_seq + accepted  # [B]: each path's last row
        logits, h = eagle.head.step(tokens.flatten(), positions.flatten(), eagle.head.combine([features]), metadata,
                                    keep_rows)
        return logits, h, next_token, first_pos + accepted + 1

    def expand(
        self,
        logits: torch.Tensor,  # [B, draft_vocab] float32: the catch-up's last row per sequence
        h: torch.Tensor,  # [B, H]: its EAGLE3 state
        root_tokens: torch.Tensor,  # [B] int64 target ids: each sequence's next token (the root)
        roots: torch.Tensor,  # [B] int64: the root's position
        table: torch.Tensor,  # [B, max_blocks] int32: the target's block table (block_size)
        block_size: int,
        last_position: int,  # max_model_len - 1: no row sits past it
        live: torch.Tensor | None = None,  # [B] bool: padding sequences (False) write no KV
        roots_host: list[int] | None = None,  # the roots on the host (eager), for backends that read lengths
    ) -> DraftTree:  # [B, num_draft_tokens], tokens in target ids
        """Depths 1..depth from the catch-up's logits and the tree chosen, on the device only."""
        eagle, topk = self.eagle, self.shape.topk
        n, device = h.shape[0], h.device
        builder = TreeBuilder(self.shape, root_tokens, self.rank_logprobs)
        frontier, parent_slot = builder.add_depth(logits)  # draft ids [n, topk], [n, topk]
        expansions = self.shape.depth - 1
        draft_block_size = eagle.draft_block_size
        draft_table = subdivide_block_table(table, block_size, draft_block_size)
        # Every depth's scratch slots, after the root: depth d's topk at root + (d - 1) * topk + j.
        scratch = roots.unsqueeze(1) + torch.arange(expansions * topk, device=device)  # [n, (depth - 1) * topk]
        slots = table.gather(1, scratch // block_size).to(torch.int64) * block_size + scratch % block_size
        if live is not None:
            slots = torch.where(live.unsqueeze(1), slots, -1)
        slots = slots.view(n, expansions, topk)
        depth_offsets = torch.arange(1, expansions + 1, device=device).unsqueeze(1)  # [depth - 1, 1]
        all_positions = (roots.unsqueeze(0) + depth_offsets).clamp(max=last_position)
        all_positions = all_positions.unsqueeze(2).expand(-1, -1, topk).flatten(1)  # [depth - 1, n * topk]
        row_starts = torch.arange(n + 1, dtype=torch.int32, device=device) * topk
        parent_h = h.unsqueeze(1).expand(n, topk, h.shape[-1])  # depth-1 rows: the root's h
        eye = torch.eye(topk, dtype=torch.bool, device=device).expand(n, topk, topk)
        mask = eye  # [n, topk, d * topk]: the newest frontier rows' ancestors (and themselves) so far
        for depth in range(1, expansions + 1):
            tokens = eagle.to_target_ids(frontier).flatten()  # [n * topk]
            states = parent_h.gather(1, parent_slot.unsqueeze(-1).expand(-1, -1, parent_h.shape[-1]))  # [n, topk, H]
            if depth > 1:  # a row sees what its parent sees, and itself
                mask = torch.cat([mask.gather(1, parent_slot.unsqueeze(-1).expand(-1, -1, mask.shape[-1])), eye], 2)
            width = depth * topk  # the frontier rows so far: this depth's are the last topk of them
            # Host lengths: the real ones when known (eager), else placeholders only a backend that
            # is never captured would read (and then the buffers' runner passes the real ones).
            seq_lens_cpu = [r + width for r in roots_host] if roots_host is not None else [width] * n
            metadata = AttentionMetadata(
                query_start_loc=row_starts, seq_lens=(roots + width).to(torch.int32), block_table=draft_table,
                slot_mapping=slots[:, depth - 1].flatten(), block_size=draft_block_size, max_query_len=topk,
                max_seq_len=max(seq_lens_cpu) if roots_host is not None else last_position + 1 + width,
                query_start_loc_cpu=[i * topk for i in range(n + 1)], seq_lens_cpu=seq_lens_cpu,
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
