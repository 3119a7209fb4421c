"""The whole draft loop of a greedy verify step as one CUDA graph (EAGLE3, MTP, a draft LM), or
the same loop run eagerly where nothing is captured (off CUDA, --enforce-eager, a capture that
failed, a drafter whose attention backend reads host lengths).

For a batch where every sequence verified q - 1 drafts (the target ran its (bucket, q) graph; a
sequence with fewer real drafts was padded to q - 1 and accepts none of the padding),
everything the drafter needs is already on the device: the verify's input tokens and positions
and block table (the target graph's static buffers), the hidden and aux hidden states (its static
outputs), and, from the greedy verification, each sequence's accepted count a and next token x.
The tokens at positions p0, p0 + 1, ... are then [t, d_1 .. d_a, x] (x also fills the positions
past it: their KV is overwritten by later steps). The captured loop:
  1. catches up over a fixed number of rows per sequence: EAGLE3/MTP rows (row_offset -1) pair
     the target's features at p0 + r with the token at p0 + r + 1 (q rows, row a drafts);
     a draft LM (row_offset 0) feeds the token at p0 + r itself (q + 1 rows, row a + 1 drafts);
  2. drafts token 1 by argmax (through d2t for EAGLE3), then m - 1 single-row steps (m drafts,
     0..K: m = 0 only catches up, the drafter's side of a k = 0 step under adaptive speculation).
With skip_catch_up (adaptive_skip_catch_up, an EAGLE3 or MTP drafter:
ProposerCapabilities.catch_up_skippable) an m = 0 step runs nothing at all: the drafter's KV
cache keeps holes at that step's positions, and the next drafting step's catch-up needs none of
them (its rows pair the target's features at p0 + r with the tokens at p0 + r + 1, all from its
own verify).
Near max_model_len, a catch-up row or chained step at or past the limit (a padded row, or a draft
never verified: the scheduler's room cap) runs at position max_model_len - 1 (ops/step
dispatch.catch_up_inputs), as the target's padded rows there do (input_batch.rows_within).
Rows of padding sequences write no KV (slot -1). It drafts greedily for every row, sampled ones
included (the verifier checks a deterministic draft against a one-hot q: exact); any other batch
shape takes the proposer's own loop (draft_loop.py, which samples a sampled request's drafts) in
the host step (runner/host_step.py). With an attention backend that loops over host copies of the lengths
(the torch reference), each forward of the loop reads its lengths from the device (one small
copy; such a loop is never captured).

The target's side arrives as arguments: the padded verify forward's buffers and outputs, typed
by the PaddedForward protocol below (the runner's CudaGraphRunner is one), and the drafter,
typed by proposer.PaddedDrafter (draft_loop.DraftLoopProposer is one). Acceptance is the verifier's
(spec_decode/verifier.py), written into this loop's input buffers (accepted, next_token, num_live).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from foretell.device_util import graph_capture
from foretell.ops.attention.metadata import AttentionMetadata, subdivide_block_table
from foretell.ops.step.dispatch import catch_up_inputs
from foretell.spec_decode.catch_up_host import catch_up_inputs_host
from foretell.spec_decode.proposer import PaddedDrafter


class ForwardOutputs(Protocol):
    hidden: torch.Tensor  # [B * q, hidden]
    aux: list[torch.Tensor]  # each [B * q, hidden]


class PaddedForward(Protocol):
    """The target's padded (bucket, q) forward over static buffers that the draft loop reads."""

    input_ids: torch.Tensor  # [max_rows] int64: the verify step's input tokens
    positions: torch.Tensor  # [max_rows] int64
    block_table: torch.Tensor  # [max_bucket, max_blocks] int32
    block_size: int
    max_model_len: int
    device: torch.device
    buckets: list[int]
    graphs: dict[tuple[int, int], ForwardOutputs]  # per (bucket, q): its static outputs
    pool: Any  # the CUDA graph memory pool the draft graphs share

    @property
    def captures(self) -> bool: ...


def device_metadata(
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    draft_block_table: torch.Tensor,  # [B, W'] int32: the blocks in the draft's block size
    slots: torch.Tensor,  # [rows] int64 flat token slots (the same in either block size)
    draft_block_size: int,
    max_query_len: int,
    max_seq_len: int,
    read_host_lengths: bool = False,  # the backend reads host lengths: copy seq_lens (a sync)
) -> AttentionMetadata:
    """Metadata of tensors computed on the device (capturable), for the draft's cache. Every
    sequence has max_query_len rows. The host copy of the lengths is a placeholder (only a backend
    that is never captured reads it) unless read_host_lengths asks for the real one."""
    num_seqs = seq_lens.shape[0]
    seq_lens_cpu = seq_lens.tolist() if read_host_lengths else [max_query_len] * num_seqs
    return AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=draft_block_table,
        slot_mapping=slots,
        block_size=draft_block_size,
        max_query_len=max_query_len,
        max_seq_len=max(seq_lens_cpu, default=1) if read_host_lengths else max_seq_len,
        query_start_loc_cpu=[i * max_query_len for i in range(num_seqs + 1)],
        seq_lens_cpu=seq_lens_cpu,
    )


@dataclass
class CapturedDraft:
    graph: "torch.cuda.CUDAGraph"
    drafts: torch.Tensor  # [bucket, k] int64 target ids


class DraftGraphRunner:
    """The padded step's draft loop, one per (bucket, q, m): after the target's (bucket, q) verify
    forward (q - 1 drafts verified, 1..K + 1 under adaptive speculation), the catch-up over its
    rows and m drafts (m in 0..K: 0 only catches up, a k = 0 step's drafter). Captured for the
    verify lengths the runner asks for (verify_lens) with m = K and m = q - 1 (a step drafting as
    many as it verified, adaptive speculation's steady state); any other (q, m) runs eagerly."""

    drafts_on_host = False  # its drafts come from the device loop (runner/host_drafts.HostDraftSlots': the host's)
    reads_rows = False  # no drafter reads the step's target rows after its read (HostDraftSlots' may)

    def __init__(self, proposer: PaddedDrafter, target: PaddedForward, k: int, reads_host_lengths: bool = False,
                 verify_lens: tuple[int, ...] | None = None, skip_catch_up: bool = False):
        self.proposer = proposer
        self.target = target
        self.k = k  # K: the most drafts a step makes or verifies
        # m = 0 runs no drafter (module docstring); only for a drafter whose cache tolerates holes.
        self.skip_catch_up = skip_catch_up
        # The verify lengths q the padded step takes (its target graphs'): K + 1, or 1..K + 1.
        self.verify_lens = tuple(sorted(set(verify_lens or (k + 1,))))
        if not all(1 <= q <= k + 1 for q in self.verify_lens):
            raise ValueError(f"draft loop verify lengths must lie in 1..{k + 1} (K + 1), got {self.verify_lens}")
        # The drafter's attention backend loops over host copies of the lengths: the loop is never
        # captured and reads each forward's lengths from the device (one small sync per forward).
        self.reads_host_lengths = reads_host_lengths
        max_bucket = target.buckets[-1]
        device = target.device
        # The loop's inputs from verification (the verifier writes them before each run()).
        self.accepted = torch.zeros(max_bucket, dtype=torch.int64, device=device)  # [max_bucket]
        self.next_token = torch.zeros(max_bucket, dtype=torch.int64, device=device)  # [max_bucket]
        self.num_live = torch.zeros((), dtype=torch.int64, device=device)  # live sequences of the bucket
        # Rows fed per sequence: the token shift is 1 for EAGLE3/MTP (row t reads token t + 1).
        self.shift = -proposer.row_offset
        i32 = dict(dtype=torch.int32, device=device)
        # Query starts of the catch-up, per rows-per-sequence count n (one per verify length).
        self.catch_up_starts = {
            self.rows_per_seq(q): torch.arange(max_bucket + 1, **i32) * self.rows_per_seq(q) for q in self.verify_lens
        }
        self.single_starts = torch.arange(max_bucket + 1, **i32)
        self.no_drafts = torch.zeros((max_bucket, 0), dtype=torch.int64, device=device)  # [max_bucket, 0]
        self.graphs: dict[tuple[int, int, int], CapturedDraft] = {}  # (bucket, q, m) -> its captured loop

    def rows_per_seq(self, q: int) -> int:
        """Catch-up rows per sequence after a verify of q rows: q (EAGLE3, MTP: row t pairs the
        target's features at t with the token at t + 1), q + 1 (a draft LM feeds each token)."""
        return q + 1 - self.shift

    def skips(self, m: int) -> bool:
        """Whether a step drafting m runs no drafter (m = 0 with skip_catch_up)."""
        return m == 0 and self.skip_catch_up

    def loop_keys(self) -> list[tuple[int, int]]:
        """The (q, m) loops captured per bucket: m = K for every verify length, and m = q - 1
        (but m = 0 when it runs nothing: skips)."""
        return sorted({(q, m) for q in self.verify_lens for m in (self.k, q - 1) if not self.skips(m)})

    def _loop(self, bucket: int, q: int, m: int) -> torch.Tensor:
        t, p = self.target, self.proposer
        rows = bucket * q
        n = self.rows_per_seq(q)
        table = t.block_table[:bucket]
        # The draft's view of the block table, once for the catch-up and every chained step.
        draft_table = subdivide_block_table(table, t.block_size, p.draft_block_size)

        def metadata(starts, seq_lens, slots, rows_per_seq):
            return device_metadata(starts, seq_lens, draft_table, slots, p.draft_block_size, rows_per_seq,
                                   t.max_model_len, self.reads_host_lengths)

        # on the CPU the verifier's outputs are host memory: the catch-up's inputs from host ints
        inputs_of = catch_up_inputs_host if t.device.type == "cpu" else catch_up_inputs
        catch_up = inputs_of(
            t.input_ids[:rows].view(bucket, q), t.positions[:rows].view(bucket, q)[:, 0], self.accepted[:bucket],
            self.next_token[:bucket], self.num_live, table, t.block_size, n, self.shift, max(m - 1, 0),
            t.max_model_len - 1,
        )
        meta = metadata(self.catch_up_starts[n][: bucket + 1], catch_up.seq_lens, catch_up.slots, n)
        aux = [a_[:rows] for a_ in t.graphs[(bucket, q)].aux]
        hidden = t.graphs[(bucket, q)].hidden[:rows]
        # A head split over tensor-parallel ranks drafts from each rank's row maxima, gathering no logits.
        greedy_only = {"greedy_only": True} if p.greedy_without_logits else {}

        def pick(out: torch.Tensor, into: torch.Tensor) -> None:  # out: logits [bucket, vocab] | drafts [bucket]
            if greedy_only:
                into.copy_(out)
            else:
                p.greedy_target_ids(out, into)

        out, state = p.padded_catch_up(catch_up.tokens, catch_up.positions, meta, hidden, aux,
                                       catch_up.last_rows, **greedy_only)
        by_step = torch.empty((m, bucket), dtype=torch.int64, device=t.device)  # each step's argmax writes a row
        if m == 0:  # a catch-up only (the drafter's KV for the accepted tokens)
            return by_step.t()
        pick(out, by_step[0])
        for j in range(1, m):
            step = catch_up.chain_step(j)
            meta = metadata(self.single_starts[: bucket + 1], step.seq_lens, step.slots, 1)
            out, state = p.chain_step(by_step[j - 1], step.positions, meta, state, **greedy_only)
            pick(out, by_step[j])
        return by_step.t()  # [bucket, m], strided

    @property
    def captures(self) -> bool:
        """Whether the loop is captured (after the target's graphs, with a graph-safe drafter)."""
        return self.target.captures and not self.reads_host_lengths

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per bucket and loop_keys() entry whose target graph exists; when capturing
        fails part-way (RuntimeError), none is kept and the loop runs uncaptured, still in the
        padded step."""
        if not self.captures:
            return
        try:
            self._capture()
        except RuntimeError:
            self.graphs.clear()
            raise

    def _capture(self) -> None:
        torch.cuda.synchronize(self.target.device)
        for q, m in self.loop_keys():
            for bucket in reversed(self.target.buckets):
                if (bucket, q) not in self.target.graphs:
                    continue
                self.num_live.fill_(0)
                for _ in range(2):
                    self._loop(bucket, q, m)
                torch.cuda.synchronize(self.target.device)
                graph = torch.cuda.CUDAGraph()
                with graph_capture(graph, pool=self.target.pool):
                    drafts = self._loop(bucket, q, m)
                self.graphs[(bucket, q, m)] = CapturedDraft(graph, drafts)
        torch.cuda.synchronize(self.target.device)

    def run(self, bucket: int, num_seqs: int, q: int | None = None, m: int | None = None) -> torch.Tensor:
        """Replay after the target's (bucket, q) forward (None: K + 1) and the verifier's
        acceptance into accepted / next_token / num_live; returns m drafts (None: K) per sequence
        [num_seqs, m]. Uncaptured (no graph for the key: off CUDA, --enforce-eager, a capture that
        failed, a (q, m) not in loop_keys()) the same loop runs eagerly; when it skips(m), nothing."""
        q = self.k + 1 if q is None else q
        m = self.k if m is None else m
        if self.skips(m):
            return self.no_drafts[:num_seqs]  # a static buffer's view, as the read-back wants
        captured = self.graphs.get((bucket, q, m))
        if captured is None:
            return self._loop(bucket, q, m)[:num_seqs]
        captured.graph.replay()
        return captured.drafts[:num_seqs]
