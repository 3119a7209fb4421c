"""The whole draft loop of a greedy verify step as one CUDA graph (EAGLE3).

For a batch where every sequence verified k drafts (the target ran its (bucket, k + 1) graph),
everything the drafter needs is already on the device: the verify's input tokens and positions
and block table (the target graph's static buffers), the aux hidden states (its static outputs),
and, from the greedy verification, each sequence's accepted count a and next token x. The
captured loop then:
  1. catches up over all k + 1 rows of each sequence (row r pairs the target's features at
     p0 + r with the token at p0 + r + 1: accepted drafts, then x; rows past a get x too and only
     write draft KV that later steps overwrite), taking row a's output;
  2. drafts token 1 by argmax (through d2t), then k - 1 single-row steps at rows p0 + a + j.
Rows of padding sequences write no KV (slot -1). Only greedy batches use it; sampled requests
and any other batch shape take the eager loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foretell.layers.attention.metadata import AttentionMetadata
from foretell.runner.cuda_graph import CudaGraphRunner
from foretell.spec_decode.draft_loop import DraftLoopProposer


def device_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,  # [rows]
    seq_of_row: torch.Tensor,  # [rows]
    live_rows: torch.Tensor,  # [rows] bool
    block_size: int,
    draft_block_size: int,
    max_query_len: int,
    max_seq_len: int,
) -> AttentionMetadata:
    """Metadata computed on the device (capturable); host copies are placeholders that only
    the torch backend would read, and it never runs inside a graph."""
    blocks = block_table[seq_of_row, positions // block_size].to(torch.int64)
    slots = torch.where(live_rows, blocks * block_size + positions % block_size, -1)
    num_seqs = seq_lens.shape[0]
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=slots,
        block_size=block_size,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        query_start_loc_cpu=[i * max_query_len for i in range(num_seqs + 1)],
        seq_lens_cpu=[max_query_len] * num_seqs,
    )
    return metadata.with_block_size(draft_block_size)


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
        i32 = dict(dtype=torch.int32, device=device)
        self.verify_starts = torch.arange(max_bucket + 1, **i32) * (k + 1)  # query_start_loc
        self.single_starts = torch.arange(max_bucket + 1, **i32)
        self.graphs: dict[int, CapturedDraft] = {}

    def _loop(self, bucket: int) -> torch.Tensor:
        k, t, p = self.k, self.target, self.proposer
        q = k + 1
        device = t.device
        rows = bucket * q
        seq_ids = torch.arange(bucket, device=device)
        live = seq_ids < self.num_live  # [bucket]
        tokens = t.input_ids[:rows].view(bucket, q)
        p0 = t.positions[:rows].view(bucket, q)[:, 0]
        a = self.accepted[:bucket]
        x = self.next_token[:bucket]
        r = torch.arange(q, device=device)
        shifted = torch.cat([tokens[:, 1:], x[:, None]], dim=1)
        shifted = torch.where(r[None, :] < a[:, None], shifted, x[:, None])  # [bucket, q]
        positions = (p0[:, None] + r[None, :]).flatten()
        seq_of_row = seq_ids.repeat_interleave(q)
        table = t.block_table[:bucket]
        meta = device_metadata(
            self.verify_starts[: bucket + 1], (p0 + q).to(torch.int32), table, positions, seq_of_row, live.repeat_interleave(q),
            t.block_size, p.draft_block_size, q, t.max_model_len,
        )
        aux = [a_[:rows] for a_ in t.graphs[(bucket, q)].aux]
        hidden = t.graphs[(bucket, q)].hidden[:rows]
        last = seq_ids * q + a
        logits, state = p.padded_catch_up(shifted.flatten(), positions, meta, hidden, aux, last)
        drafts = [p.to_target_ids(logits.argmax(dim=-1))]
        for j in range(1, k):
            row_pos = p0 + a + j  # the row of draft j (EAGLE: one before the token's position)
            meta = device_metadata(
                self.single_starts[: bucket + 1], (row_pos + 1).to(torch.int32), table, row_pos,
                seq_ids, live,
                t.block_size, p.draft_block_size, 1, t.max_model_len,
            )
            logits, state = p.chain_step(drafts[-1], row_pos, meta, state)
            drafts.append(p.to_target_ids(logits.argmax(dim=-1)))
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
