"""Drafting a tree with a model drafter (issue 28): the catch-up, then depth-by-depth expansion.

The drafter is a DraftLoopProposer: an EAGLE3 head or a draft LM (MTP's target is MLA, which has no
tree mask yet). The catch-up is the chain's (proposer.catch_up over the accepted rows): its last
row's draft logits give depth 1 (the topk tokens after the root, the sequence's next token). Each
later depth runs the drafter over the frontier nodes kept so far, topk per depth, fed their own
token (and, for EAGLE3, their parent's h: the catch-up's last row for depth-1 nodes), at row
position root position + depth + row_offset: EAGLE3 rows pair features at t with the token at
t + 1 (row_offset -1), a draft LM feeds a token at its own position (row_offset 0).

The frontier rows' keys and values go to scratch slots of the draft cache, right after the last
key the catch-up wrote (the root's row for a draft LM, the row before it for EAGLE3): from
scratch base = root + 1 + row_offset, depth d's topk rows at base + (d - 1) * topk + j. The
forward at depth d runs only that depth's topk new rows per sequence; the earlier frontier rows'
K/V are already cached at the (d - 1) * topk slots just before them, so each new row reaches its
ancestors through the tree mask's columns, which address the sequence's last d * topk keys
(ops/attention: a [topk, d * topk] ancestor mask per sequence, the verified context seen whole).
None of the scratch survives the step: the next catch-up writes the accepted path's draft KV in
place (the rows of the path, from the target's verify), so the draft cache never needs compaction.

Trees are drafted from the drafter's plain logits for greedy and sampled requests alike (top-k
drafts are deterministic: verify_sampled takes them with one-hot q). The runner keeps the
returned tree per sequence until its verify (runner/tree_step.py).

EAGLE3 only, so far: after a graphed verify the catch-up itself runs from device inputs
(padded_catch_up: the accepted path padded to depth + 1 rows, no host read), and the runner
replays catch-up and expansion as one CUDA graph per batch bucket (tree/draft_graphs.py). A draft
LM's tree is drafted by the same code eagerly: its catch-up from the path's rows, then expand()
(device work only: slots, positions, masks and the tree built on the device, no host read).
"""

from __future__ import annotations

import torch

from foretell.device_util import to_device
from foretell.ops.attention.metadata import AttentionMetadata, subdivide_block_table
from foretell.ops.step.reference import catch_up_rows_torch
from foretell.spec_decode.proposer import DraftBatch
from foretell.spec_decode.tree.build import TreeBuilder
from foretell.spec_decode.tree.shape import DraftTree, TreeShape


class ModelTreeDrafter:
    def __init__(self, proposer, shape: TreeShape, rank_logprobs: torch.Tensor | None = None):
        self.proposer = proposer  # a loaded DraftLoopProposer: Eagle3Proposer or DraftModelProposer
        self.shape = shape
        self.rank_logprobs = rank_logprobs  # [depth, topk]: simulated acceptance's tree shape (tree/simulated.py)
        self.graphs = None  # tree/draft_graphs.TreeDraftGraphs: the expansion on graphs (None: eager)

    def draft(self, batch: DraftBatch, drafting: list[int]) -> DraftTree | None:
        """Catch up every sequence of the batch; draft a tree for the sequences `drafting` names
        (indices into the batch). Returns their trees [len(drafting), num_draft_tokens] in target
        ids, or None when none drafts."""
        logits, state = self.proposer.catch_up(batch, drafting)  # [n, draft_vocab] float32, the drafter's state
        if not drafting:
            return None
        root_tokens = [batch.next_token_ids[i] for i in drafting]
        # The root sits at num_tokens_after_step - 1; a depth-d node's row at root + d + row_offset.
        roots = [batch.num_tokens_after_step(i) - 1 for i in drafting]
        n, device = len(drafting), logits.device
        every = drafting == list(range(batch.block_table.shape[0]))  # the usual case: the table as it is
        table = batch.block_table  # [n, max_blocks] int32 once only the drafting rows are kept
        if self.graphs is not None:  # the graphs upload the roots themselves
            if not every:
                table = table[to_device(drafting, torch.int64, device)]
            tree = self.graphs.run(logits, state, root_tokens, roots, table)
            if tree is not None:
                return tree
        # Eager: one upload, the root tokens, the roots, then (unless every sequence drafts, or the
        # graphs' path took them already) which table rows.
        pick = not every and table is batch.block_table
        host_ints = to_device(root_tokens + roots + (drafting if pick else []), torch.int64, device)
        if pick:
            table = table[host_ints[2 * n:]]
        return self.expand(logits, state, host_ints[:n], host_ints[n: 2 * n], table,
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
        eagle = self.proposer  # an Eagle3Proposer (draft_graphs.py runs only EAGLE3's)
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
        state,  # the drafter's state after the catch-up (EAGLE3: h [B, H]; a draft LM: None)
        root_tokens: torch.Tensor,  # [B] int64 target ids: each sequence's next token (the root)
        roots: torch.Tensor,  # [B] int64: the root's position
        table: torch.Tensor,  # [B, max_blocks] int32: the target's block table (block_size)
        block_size: int,
        last_position: int,  # max_model_len - 1: no row sits past it
        live: torch.Tensor | None = None,  # [B] bool: padding sequences (False) write no KV
        roots_host: list[int] | None = None,  # the roots on the host (eager), for backends that read lengths
    ) -> DraftTree:  # [B, num_draft_tokens], tokens in target ids
        """Depths 1..depth from the catch-up's logits and the tree chosen, on the device only."""
        proposer, topk = self.proposer, self.shape.topk
        n, device = logits.shape[0], logits.device
        builder = TreeBuilder(self.shape, root_tokens, self.rank_logprobs)
        frontier, parent_slot = builder.add_depth(logits)  # draft ids [n, topk], [n, topk]
        expansions = self.shape.depth - 1
        draft_block_size = proposer.draft_block_size
        draft_table = subdivide_block_table(table, block_size, draft_block_size)
        # Every depth's scratch slots, after the catch-up's last row (at root + row_offset): depth d's
        # topk at base + (d - 1) * topk + j.
        base = roots + 1 + proposer.row_offset  # [n]
        scratch = base.unsqueeze(1) + torch.arange(expansions * topk, device=device)  # [n, (depth - 1) * topk]
        slots = table.gather(1, scratch // block_size).to(torch.int64) * block_size + scratch % block_size
        if live is not None:
            slots = torch.where(live.unsqueeze(1), slots, -1)
        slots = slots.view(n, expansions, topk)
        # A depth-d node's token sits at root + d, its row at root + d + row_offset (the chain's rule).
        depth_offsets = torch.arange(1, expansions + 1, device=device).unsqueeze(1) + proposer.row_offset
        all_positions = (roots.unsqueeze(0) + depth_offsets).clamp(max=last_position)
        all_positions = all_positions.unsqueeze(2).expand(-1, -1, topk).flatten(1)  # [depth - 1, n * topk]
        row_starts = torch.arange(n + 1, dtype=torch.int32, device=device) * topk
        parents = torch.arange(n * topk, device=device) // topk  # depth-1 rows: the root's state (no host read)
        eye = torch.eye(topk, dtype=torch.bool, device=device).expand(n, topk, topk)
        mask = eye  # [n, topk, d * topk]: the newest frontier rows' ancestors (and themselves) so far
        bases_host = None if roots_host is None else [r + 1 + proposer.row_offset for r in roots_host]
        for depth in range(1, expansions + 1):
            tokens = proposer.to_target_ids(frontier).flatten()  # [n * topk]
            if depth > 1:  # a row sees what its parent sees, and itself
                parents = (torch.arange(n, device=device).unsqueeze(1) * topk + parent_slot).flatten()  # [n * topk]
                mask = torch.cat([mask.gather(1, parent_slot.unsqueeze(-1).expand(-1, -1, mask.shape[-1])), eye], 2)
            width = depth * topk  # the frontier rows so far: this depth's are the last topk of them
            # Host lengths: the real ones when known (eager), else placeholders only a backend that
            # is never captured would read (and then the buffers' runner passes the real ones).
            seq_lens_cpu = [b + width for b in bases_host] if bases_host is not None else [width] * n
            metadata = AttentionMetadata(
                query_start_loc=row_starts, seq_lens=(base + width).to(torch.int32), block_table=draft_table,
                slot_mapping=slots[:, depth - 1].flatten(), block_size=draft_block_size, max_query_len=topk,
                max_seq_len=max(seq_lens_cpu) if bases_host is not None else last_position + 1 + width,
                query_start_loc_cpu=[i * topk for i in range(n + 1)], seq_lens_cpu=seq_lens_cpu,
                tree_mask=mask.reshape(n * topk, width),
            )
            out, state = proposer.tree_step(tokens, all_positions[depth - 1],
                                            proposer.select_state_rows(state, parents), metadata)
            frontier, parent_slot = builder.add_depth(out.view(n, topk, -1))  # out [n * topk, draft_vocab]
        tree = builder.finish()
        nodes = proposer.to_target_ids(tree.tokens[:, 1:])
        tree.tokens = torch.cat([tree.tokens[:, :1], nodes], 1)
        return tree
