"""The whole draft loop of a greedy verify step as one CUDA graph (EAGLE3, MTP, a draft LM).

For a batch where every sequence verified k drafts (the target ran its (bucket, k + 1) graph),
everything the drafter needs is already on the device: the verify's input tokens and positions
and block table (the target graph's static buffers), the hidden and aux hidden states (its static
outputs), and, from the greedy verification, each sequence's accepted count a and next token x.
The tokens at positions p0, p0 + 1, ... are then [t, d_1 .. d_a, x] (x also fills the positions
past it: their KV is overwritten by later steps). The captured loop:
  1. catches up over a fixed number of rows per sequence: EAGLE3/MTP rows (row_offset -1) pair
     the target's features at p0 + r with the token at p0 + r + 1 (k + 1 rows, row a drafts);
     a draft LM (row_offset 0) feeds the token at p0 + r itself (k + 2 rows, row a + 1 drafts);
  2. drafts token 1 by argmax (through d2t for EAGLE3), then k - 1 single-row steps.
Rows of padding sequences write no KV (slot -1). Only greedy batches use it; sampled requests
and any other batch shape take the eager loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foretell.layers.attention.metadata import AttentionMetadata, subdivide_block_table
from foretell.layers.sampler import argmax_rows
from foretell.runner.cuda_graph import CudaGraphRunner
from foretell.spec_decode.draft_loop import DraftLoopProposer


def device_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,  # [num_seqs, max_blocks] in the target's blocks
    positions: torch.Tensor,  # [rows]
    seq_of_row: torch.Tensor,  # [rows]
    live_rows: torch.Tensor,  # [rows] bool
    block_size: int,
    draft_block_table: torch.Tensor,  # block_table in blocks of the draft's size (with_block_size)
    draft_block_size: int,
    max_query_len: int,
    max_seq_len: int,
) -> AttentionMetadata:
    """Metadata computed on the device (capturable), for the draft's cache; host copies are
    placeholders that only the torch backend would read, and it never runs inside a graph."""
    blocks = block_table[seq_of_row, positions // block_size].to(torch.int64)
    slots = torch.where(live_rows, blocks * block_size + positions % block_size, -1)
    num_seqs = seq_lens.shape[0]
    return AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=draft_block_table,
        slot_mapping=slots,  # flat token slots: the same in either block size
        block_size=draft_block_size,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        query_start_loc_cpu=[i * max_query_len for i in range(num_seqs + 1)],
        seq_lens_cpu=[max_query_len] * num_seqs,
    )


@dataclass
class CapturedDraft:
    graph: "torch.cuda.CUDAGraph | None"  # None off CUDA: run() recomputes (tests)
    drafts: torch.Tensor  # [bucket, k] int64 target ids


class DraftGraphRunner:
    def __init__(self, proposer: DraftLoopProposer, target: CudaGraphRunner, k: int):
        self.proposer = proposer
        self.target = target
        self.k = k
        max_bucket = target.buckets[-1]
        device = target.device
        self.accepted = torch.zeros(max_bucket, dtype=torch.int64, device=device)
        self.next_token = torch.zeros(max_bucket, dtype=torch.int64, device=device)
        self.num_live = torch.zeros((), dtype=torch.int64, device=device)
        # Rows fed per sequence: the token shift is 1 for EAGLE3/MTP (row t reads token t + 1).
        self.shift = -proposer.row_offset
        self.rows_per_seq = k + 2 - self.shift
        i32 = dict(dtype=torch.int32, device=device)
        self.catch_up_starts = torch.arange(max_bucket + 1, **i32) * self.rows_per_seq
        self.single_starts = torch.arange(max_bucket + 1, **i32)
        # Constants of the loop, made once (each would be a launch in every replay): the
        # sequence of each row, each sequence's first catch-up row, each catch-up row's offset.
        self.seq_ids = torch.arange(max_bucket, device=device)  # [max_bucket]
        self.catch_up_seq = self.seq_ids.repeat_interleave(self.rows_per_seq)  # [max_bucket * rows_per_seq]
        self.catch_up_first_row = self.seq_ids * self.rows_per_seq  # [max_bucket]
        self.offsets = torch.arange(k + 2, device=device)  # position offsets p0 + 0 .. p0 + k + 1
        self.graphs: dict[int, CapturedDraft] = {}

    def _loop(self, bucket: int) -> torch.Tensor:
        k, t, p = self.k, self.target, self.proposer
        q = k + 1
        rows = bucket * q
        n = self.rows_per_seq
        seq_ids, offset = self.seq_ids[:bucket], self.offsets
        live = seq_ids < self.num_live  # [bucket]
        catch_up_seq = self.catch_up_seq[: bucket * n]  # [bucket * n]
        tokens = t.input_ids[:rows].view(bucket, q)
        p0 = t.positions[:rows].view(bucket, q)[:, 0]
        a = self.accepted[:bucket]
        x = self.next_token[:bucket]
        at_position = torch.cat([tokens, x[:, None]], dim=1)
        at_position = torch.where(offset[None, :] <= a[:, None], at_position, x[:, None])
        fed = at_position[:, self.shift : self.shift + n]  # [bucket, n] token fed at each row
        positions = (p0[:, None] + offset[None, :n]).flatten()
        table = t.block_table[:bucket]
        # The draft's view of the block table, once for the catch-up and every chained step.
        draft_table = subdivide_block_table(table, t.block_size, p.draft_block_size)

        def metadata(starts, seq_lens, row_positions, row_seq, row_live, rows_per_seq):
            return device_metadata(starts, seq_lens.to(torch.int32), table, row_positions, row_seq, row_live,
                                   t.block_size, draft_table, p.draft_block_size, rows_per_seq, t.max_model_len)

        meta = metadata(self.catch_up_starts[: bucket + 1], p0 + n, positions, catch_up_seq,
                        catch_up_seq < self.num_live, n)
        aux = [a_[:rows] for a_ in t.graphs[(bucket, q)].aux]
        hidden = t.graphs[(bucket, q)].hidden[:rows]
        next_row = a + (1 - self.shift)  # per sequence: the catch-up row that sees x, drafting token 1
        last = self.catch_up_first_row[:bucket] + next_row
        logits, state = p.padded_catch_up(fed.flatten(), positions, meta, hidden, aux, last)
        drafts = [p.to_target_ids(argmax_rows(logits))]
        for j in range(1, k):
            # Draft j sits at position p0 + a + 1 + j; its row is row_offset from there.
            row_pos = p0 + next_row + j
            meta = metadata(self.single_starts[: bucket + 1], row_pos + 1, row_pos, seq_ids, live, 1)
            logits, state = p.chain_step(drafts[-1], row_pos, meta, state)
            drafts.append(p.to_target_ids(argmax_rows(logits)))
        return torch.stack(drafts, dim=1)  # [bucket, k]

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.target.captures:
            return
        torch.cuda.synchronize(self.target.device)
        for bucket in reversed(self.target.buckets):
            self.num_live.fill_(0)
            for _ in range(2):
                self._loop(bucket)
            torch.cuda.synchronize(self.target.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.target.pool):
                drafts = self._loop(bucket)
            self.graphs[bucket] = CapturedDraft(graph, drafts)
        torch.cuda.synchronize(self.target.device)

    def run(self, bucket: int, num_seqs: int, accepted: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
        """Replay after the target's (bucket, k + 1) graph; returns drafts [num_seqs, k]."""
        self.accepted[:num_seqs].copy_(accepted)
        self.next_token[:num_seqs].copy_(next_token)
        self.num_live.fill_(num_seqs)
        if not self.target.captures:
            return self._loop(bucket)[:num_seqs]
        captured = self.graphs[bucket]
        captured.graph.replay()
        return captured.drafts[:num_seqs]
