"""CUDA graphs for the target's decode and verify forwards.

A batch where every sequence feeds the same number of rows q (1 for decode, 1 + k to verify k
drafts) runs as the replay of a graph captured for (batch bucket, q): the smallest captured
bucket B >= num_seqs, padded with dummy sequences whose rows write no KV (slot -1). Inputs live in
persistent buffers that each step overwrites (in one copy and one launch: runner/graph_inputs.py);
outputs (final hidden states, the aux hidden states EAGLE3 reads, the logits of every row and
their argmax, which greedy sampling takes without a launch of its own) are static tensors of the
graph, sliced to the live rows after replay. Any other batch (prefill chunks, mixed query lengths)
runs eagerly. A greedy decode step after a decode step on the same graph for the same sequences may
skip all that: advance_decode moves the buffers one position on, on the device (ops/step/decode_advance.py).

Off CUDA (a graph-safe backend on the CPU, i.e. Triton's interpreter in tests), and with
`capture_graphs` off (--enforce-eager, or a capture that failed), nothing is captured: run()
executes the same forward on the same static buffers, so this path is tested in CI exactly as it
runs on a GPU, minus the capture. This uncaptured runner is what the padded verify step
(graphed_verify.py) runs on when there are no graphs. With `reads_host_lengths` (an attention
backend that loops over host copies of the lengths, such as the torch reference, the CPU's
default) it is never captured, a batch of n sequences takes the exact bucket n (no padding
sequences, whose slot -1 such a backend would not skip), and the metadata's host copies are read
from the buffers.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from foretell.device_util import graph_capture
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.layers.sampler import argmax_rows
from foretell.ops.step.decode_advance import advance_decode_inputs
from foretell.ops.step.dispatch import advance_verify_inputs, unpack_graph_inputs
from foretell.ops.step.inputs import GraphInputBuffers
from foretell.ops.step.verify_to_decode import verify_to_decode_inputs
from foretell.runner import graph_inputs
from foretell.runner.input_batch import InputBatch, build_block_table

if TYPE_CHECKING:
    from foretell.runner.split_step import ForwardRows

logger = logging.getLogger("foretell")


def batch_buckets(max_num_seqs: int) -> list[int]:
    buckets = [1, 2, 4, 8]
    while buckets[-1] < max_num_seqs:
        buckets.append(buckets[-1] + (8 if buckets[-1] < 32 else 16 if buckets[-1] < 128 else 32))
    return [b for b in buckets if b < max_num_seqs] + [max_num_seqs]


class CapturedForward:
    """A (bucket, q) forward's outputs: a graph's static tensors, or an uncaptured run's. An
    uncaptured forward of a model whose vocabulary is split over tensor-parallel ranks takes its
    greedy tokens from each rank's row maxima and gathers the whole logits rows only when a reader
    asks for them (a greedy step asks for none): `logits` may be given as a function of nothing."""

    __slots__ = ("graph", "hidden", "aux", "greedy", "_logits")

    def __init__(self, graph: "torch.cuda.CUDAGraph | None", hidden: torch.Tensor, aux: list[torch.Tensor],
                 logits: "torch.Tensor | Callable[[], torch.Tensor]", greedy: torch.Tensor):
        self.graph = graph  # None: uncaptured (off CUDA), run() recomputes
        self.hidden = hidden  # [B * q, hidden]
        self.aux = aux  # each [B * q, hidden]
        self._logits = logits
        self.greedy = greedy  # [B * q] int64: each row's argmax, what greedy sampling picks

    @property
    def logits(self) -> torch.Tensor:  # [B * q, vocab] float32
        if callable(self._logits):
            self._logits = self._logits()
        return self._logits


class CudaGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        max_num_seqs: int,
        query_lens: tuple[int, ...],
        max_blocks_per_seq: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        capture_graphs: bool = True,  # False: every replay runs the forward itself (eager)
        reads_host_lengths: bool = False,  # the attention backend reads host copies of the lengths
    ):
        self.model = model
        self.capture_graphs = capture_graphs and not reads_host_lengths
        self.reads_host_lengths = reads_host_lengths
        self.buckets = batch_buckets(max_num_seqs)
        self.query_lens = tuple(sorted(set(query_lens)))
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        max_rows = self.buckets[-1] * max(self.query_lens)
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_rows, **i64)
        self.positions = torch.zeros(max_rows, **i64)
        self.slot_mapping = torch.full((max_rows,), -1, **i64)
        self.query_start_loc = torch.zeros(self.buckets[-1] + 1, **i32)
        self.seq_lens = torch.ones(self.buckets[-1], **i32)
        self.block_table = torch.zeros(self.buckets[-1], max_blocks_per_seq, **i32)
        self.buffers = GraphInputBuffers(self.input_ids, self.positions, self.slot_mapping, self.query_start_loc,
                                         self.seq_lens, self.block_table)
        # A packed step (graph_inputs.pack) of the largest bucket and query length.
        self.staging = torch.zeros(3 * max_rows + 2 * self.buckets[-1] + 1 + self.block_table.numel(), **i64)
        self.side = graph_inputs.SideStream(device)
        self.unpack_launches: dict = {}  # the unpack's compiled kernels, launched directly (ops/step)
        self.advance_launches: dict = {}  # advance_decode's compiled kernel, launched directly
        self.verify_to_decode_launches: dict = {}  # verify_to_decode's, the same way
        # Counts every write of the input buffers: a step that recorded it after its own write knows
        # the buffers still hold its inputs while it is unchanged (what advance_decode builds on).
        self.inputs_version = 0
        self.table_rows: tuple | None = None  # the block ids advance_verify last uploaded, while they stand
        self.graphs: dict[tuple[int, int], CapturedForward] = {}
        self.pool = None

    # ---- capture -------------------------------------------------------------------------
    def _metadata(self, bucket: int, q: int) -> AttentionMetadata:
        if self.reads_host_lengths:  # never captured: the lengths the buffers hold now
            seq_lens_cpu = self.seq_lens[:bucket].tolist()
            max_seq_len = max(seq_lens_cpu)
        else:  # host copies are only read by the torch backend, which never runs in a graph
            seq_lens_cpu, max_seq_len = [q] * bucket, self.max_model_len
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_table=self.block_table[:bucket],
            slot_mapping=self.slot_mapping[: bucket * q],
            block_size=self.block_size,
            max_query_len=q,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=[i * q for i in range(bucket + 1)],
            seq_lens_cpu=seq_lens_cpu,
        )

    def _forward(self, bucket: int, q: int):
        """(hidden, aux, logits, greedy) of graph `key`'s rows; uncaptured with the vocabulary split
        over ranks, logits as a function (CapturedForward) and greedy from the ranks' row maxima."""
        rows = bucket * q
        hidden, aux = self.model(self.input_ids[:rows], self.positions[:rows], self._metadata(bucket, q))
        if not self.captures and getattr(self.model, "splits_vocabulary", False):
            return hidden, aux, lambda: self.model.compute_logits(hidden), self.model.compute_greedy_tokens(hidden)
        logits = self.model.compute_logits(hidden)
        return hidden, aux, logits, argmax_rows(logits)

    @property
    def captures(self) -> bool:
        return self.device.type == "cuda" and self.capture_graphs

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.captures:
            return
        torch.cuda.synchronize(self.device)
        for q in self.query_lens:
            for bucket in reversed(self.buckets):  # largest first: later graphs reuse its pool
                self._reset_padding(0, bucket, q)
                for _ in range(2):  # compile Triton kernels and warm cuBLAS outside capture
                    self._forward(bucket, q)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with graph_capture(graph, pool=self.pool):
                    hidden, aux, logits, greedy = self._forward(bucket, q)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[(bucket, q)] = CapturedForward(graph, hidden, list(aux), logits, greedy)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs (buckets %s, query lengths %s)",
                    len(self.graphs), self.buckets, self.query_lens)

    def prepare_replay(self, key: tuple[int, int], context_len: int) -> None:
        """Make graph `key` safe to replay on its own, as benchmarks time bare replays: every row
        of its bucket becomes a sequence of `context_len` tokens over cache blocks 0, 1, ...
        (which the cache must hold), writing no KV. Without this a replay reads whatever the last
        step left, which may describe another query length than the graph's (out-of-bounds rows)."""
        bucket, q = key
        blocks = -(-context_len // self.block_size)
        if bucket not in self.buckets or q not in self.query_lens:
            raise ValueError(f"no graph for (bucket, q) = {key}; buckets {self.buckets}, "
                             f"query lengths {self.query_lens}")
        if not q <= context_len <= self.max_model_len or blocks > self.block_table.shape[1]:
            raise ValueError(f"context_len {context_len} must be in [{q}, {self.max_model_len}] "
                             f"and fit {self.block_table.shape[1]} blocks of {self.block_size}")
        self.side.before_input_write()
        self.inputs_version += 1
        self._reset_padding(0, bucket, q)
        self.table_rows = None
        self.seq_lens[:bucket] = context_len
        self.block_table[:bucket, :blocks] = torch.arange(blocks, dtype=torch.int32, device=self.device)

    def _reset_padding(self, num_seqs: int, bucket: int, q: int) -> None:
        """Dummy sequences num_seqs..bucket-1: q rows each, context q, no KV writes."""
        self.query_start_loc[num_seqs : bucket + 1] = torch.arange(
            num_seqs * q, (bucket + 1) * q, q, dtype=torch.int32, device=self.device
        )
        self.seq_lens[num_seqs:bucket] = q
        self.slot_mapping[num_seqs * q : bucket * q] = -1
        self.positions[num_seqs * q : bucket * q] = 0

    # ---- replay ----------------------------------------------------------------------------
    def bucket_for(self, batch: InputBatch) -> tuple[int, int] | None:
        q = batch.max_query_len
        num_seqs = batch.num_seqs
        if q not in self.query_lens or batch.num_tokens != q * num_seqs:
            return None
        if num_seqs > self.buckets[-1] or batch.block_table_width > self.block_table.shape[1]:
            return None
        if self.reads_host_lengths:  # no padding sequences (see the module docstring)
            return num_seqs, q
        bucket = next(b for b in self.buckets if b >= num_seqs)
        return bucket, q

    def run(self, batch: InputBatch, key: tuple[int, int]) -> CapturedForward:
        """Replay for a batch bucket_for() accepted; the graph's static outputs (rows past
        batch.num_tokens are padding). Its inputs arrive in one copy and one launch
        (runner/graph_inputs.py)."""
        self._write_inputs(batch, key)
        return self.replay(key)

    def load(self, batch: InputBatch, key: tuple[int, int], computed: "ForwardRows") -> CapturedForward:
        """run() for a batch whose forward ran elsewhere (one eager forward over a split batch's
        verifies and prompt chunks: split_step.py): its inputs written as run() writes them, its
        outputs (hidden [rows, hidden], aux, logits [rows, vocab] float32 of its rows, greedy
        tokens) put where a replay of graph `key` leaves them, for the verification and the draft
        loop to read (uncaptured, logits still gathered only when read)."""
        self._write_inputs(batch, key)
        rows = batch.num_tokens
        if self.captures:
            out, logits = self.graphs[key], computed.logits
            greedy = argmax_rows(logits) if computed.greedy is None else computed.greedy  # [rows] int64
            for static, value in zip([out.hidden, *out.aux, out.logits, out.greedy],
                                     [computed.hidden, *computed.aux, logits, greedy]):
                static[:rows].copy_(value)
            return out
        padded_rows = key[0] * key[1]  # as an uncaptured forward's outputs: the bucket's rows

        def padded(t: torch.Tensor) -> torch.Tensor:
            return t if t.shape[0] == padded_rows else torch.cat([t, t.new_zeros(padded_rows - rows, *t.shape[1:])])

        greedy = argmax_rows(computed.logits) if computed.greedy is None else computed.greedy
        self.graphs.clear()
        self.graphs[key] = CapturedForward(None, padded(computed.hidden), [padded(a) for a in computed.aux],
                                           lambda: padded(computed.logits), padded(greedy))
        return self.graphs[key]

    def _write_inputs(self, batch: InputBatch, key: tuple[int, int]) -> None:
        """The batch's inputs into the buffers of graph `key`, in one copy and one launch."""
        host, layout, slot = graph_inputs.pack(batch, *key, self.side.uploads)
        staging = self.staging[: layout.size]
        self.side.upload(staging, host, slot)
        tokens = staging[layout.ids_offset :] if layout.ids_on_host else batch.token_ids
        self.side.before_input_write()
        unpack_graph_inputs(staging, tokens, self.buffers, layout, self.unpack_launches)
        self.side.after_input_write()
        self.inputs_version += 1
        self.table_rows = None  # recorded only by advance_verify: no per-step host work on this path

    def advance_decode(self, key: tuple[int, int], num_seqs: int, tokens: torch.Tensor) -> CapturedForward:
        """Replay decode graph `key` (q = 1) for the step after the one its buffers hold: each of the
        first num_seqs sequences feeds tokens[i] ([num_seqs] int64 on the device, the last replay's
        argmax) at its position + 1, over the block table the buffers hold (the caller checked that
        each next position lies in it). One launch, no upload (ops/step/decode_advance.py); query
        starts, padding sequences and the table stay as they are."""
        self.side.before_input_write()
        advance_decode_inputs(self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
                              self.block_table[:num_seqs], tokens, self.block_size, self.advance_launches)
        self.side.after_input_write()
        self.inputs_version += 1
        return self.replay(key)

    def verify_to_decode(self, key: tuple[int, int], num_seqs: int, q: int, accepted: torch.Tensor,
                         next_token: torch.Tensor) -> CapturedForward:
        """Replay decode graph `key` (bucket, q = 1) for the plain step after the verify step its
        buffers hold (q rows per sequence, the same bucket): each of the first num_seqs sequences
        feeds next_token[i] one position past its accepted[i] drafts ([>= num_seqs] int64 on the
        device, the device's verification of that step), over the block table the buffers hold (the
        caller checked that the furthest such position lies in it). One launch, no upload
        (ops/step/verify_to_decode.py)."""
        self.side.before_input_write()
        verify_to_decode_inputs(self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.query_start_loc,
                                self.block_table[:num_seqs], accepted, next_token, num_seqs, key[0], q,
                                self.block_size, self.verify_to_decode_launches)
        self.side.after_input_write()
        self.inputs_version += 1
        self.table_rows = None  # the buffers hold a decode step now
        return self.replay(key)

    def download_input_ids(self, rows: int) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        """The input ids of the step last unpacked (its first `rows`), copied to the host beside
        the graphs: (host tensor, ready event) (runner/graph_inputs.SideStream)."""
        return self.side.download(self.input_ids[:rows])

    def replay(self, key: tuple[int, int]) -> CapturedForward:
        """Run graph `key` on whatever the input buffers hold now."""
        if not self.captures:
            hidden, aux, logits, greedy = self._forward(*key)
            self.graphs.clear()  # uncaptured: only the latest outputs are held (none per bucket)
            self.graphs[key] = CapturedForward(None, hidden, list(aux), logits, greedy)
        else:
            self.graphs[key].graph.replay()
        return self.graphs[key]

    def advance_verify(
        self,
        num_seqs: int,
        accepted: torch.Tensor,  # [num_seqs] int64: drafts the step in the buffers accepted
        next_token: torch.Tensor,  # [num_seqs] int64: the target's token after them
        drafts: torch.Tensor,  # [num_seqs, q - 1] int64: the drafts to verify next
        block_ids: list[list[int]],  # each sequence's cache blocks now
    ) -> None:
        """Turn the buffers of a verify step (q rows per sequence) into those of the next one,
        on the device: each sequence moves past its accepted drafts and its next token
        (p0 -> p0 + accepted + 1) and feeds [next_token, drafts] over its current block table
        (uploaded only when the scheduler added blocks since the buffers were written: a copy on
        the stream costs the device several microseconds). Query starts and the padding sequences
        stay as they are."""
        self.side.before_input_write()
        self.inputs_version += 1
        rows = tuple(map(tuple, block_ids))
        if rows != self.table_rows:
            table = build_block_table(block_ids, self.device)  # [num_seqs, width]
            self.block_table[:num_seqs, : table.shape[1]].copy_(table, non_blocking=True)
            self.table_rows = rows
        advance_verify_inputs(self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
                              self.block_table[:num_seqs], accepted, next_token, drafts, self.block_size)
