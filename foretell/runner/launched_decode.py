"""LaunchedDecode: one plain decode step queued on the device whose tokens the host has not read
yet (runner/decode_ahead.py says what such a step is, when it is queued and why dropping it is
safe): its launch of the step after it (on the device when the graph's buffers still hold its
inputs; a grammar step's as its forward alone, PendingGrammarSample, masked and sampled by
complete() once the scheduler takes it), its read and whether the scheduler's next decision is
it. plain_decode() says which batches such steps are; next_rows() where the step after one goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from foretell.engine.scheduler import ScheduledSequence
from foretell.engine.sequence import Sequence
from foretell.runner.input_batch import InputBatch, build_decode_batch
from foretell.runner.logprobs import PaddedLogprobs, read_padded_logprobs
from foretell.runner.padded_logits_controls import PaddedLogitsControls, padded_step_takes
from foretell.runner.sequence_result import SequenceResult
from foretell.runner.step_pipeline import HostCopy
from foretell.structured.padded_verify import PaddedVerifyGrammar

if TYPE_CHECKING:
    from foretell.runner.decode_ahead import DecodeAhead


def plain_decode(scheduled: list[ScheduledSequence], grammars: bool = False) -> bool:
    """Every sequence feeds one row, samples, carries no drafts and (unless `grammars`) follows
    no grammar.

    A queued step samples before the host has appended the previous token, which is exact
    because sampling reads only the row's parameters and position (seeds) and the logits
    controls' device state (advanced by the step before it on the device), never the host's
    token lists: a grammar, whose matcher state lives on the host, keeps its requests out of
    every queued step (`grammars`: a launch from host inputs, which fills their masks)."""
    for item in scheduled:  # a loop, not all() over a generator: this runs twice a decode step
        if item.num_new_tokens != 1 or not item.samples or item.draft_token_ids:
            return False
        if not grammars and not padded_step_takes(item.seq.sampling_params):
            return False
    return True


@dataclass
class PendingGrammarSample:
    """A grammar decode step queued ahead as its forward alone: what LaunchedDecode.complete()
    needs to mask and sample its logits once the host has the previous step's tokens."""

    raw_logits: torch.Tensor  # [num_seqs, vocab] float32 (a graph's output: valid until its next replay)
    row_positions: list[int]  # per sequence: the position of the token it samples (seeds)


@dataclass
class LaunchedDecode:
    """A decode step queued on the device whose tokens the host has not read yet."""

    drafter_rows = None  # (no drafter reads a decode step's rows: step_pipeline.QueuedStep)
    kind: DecodeAhead  # what launched it, and launches the step after it
    seqs: list[Sequence]
    positions: list[int]  # per sequence: the position of the step's input token
    slots: list[int]  # per sequence: the cache slot the step wrote its K/V to
    token_ids: torch.Tensor | None  # [num_seqs] int64 on the device: what the step sampled (None: pending)
    copy: HostCopy | None  # of token_ids; None: a graph's argmax, copied once the next step is queued
    graphed: bool  # token_ids is a CUDA graph's argmax output (the next replay overwrites it)
    controls: PaddedLogitsControls | None = None  # the logits controls' device state (None: none)
    logprobs: PaddedLogprobs | None = None  # which sequences want logprobs; in the copy after the tokens
    all_greedy: bool | None = None  # every sequence samples greedily (None: not known)
    # A greedy step on a graph: its key, the graph runner's inputs_version right after its inputs
    # were written, and per sequence the first position past the blocks the buffers' table holds.
    graph_key: tuple[int, int] | None = None
    inputs_version: int = -1
    table_ends: list[int] | None = None
    grammar: PaddedVerifyGrammar | None = None  # the step's grammar masks (None: no sequence has one)
    # A grammar step queued ahead as its forward alone (module docstring): complete() masks and
    # samples it; None once it has (or for every other step).
    pending: PendingGrammarSample | None = None

    @classmethod
    def queue(
        cls, kind: DecodeAhead, seqs: list[Sequence], batch: InputBatch, token_ids: torch.Tensor,
        graphed: bool = False, controls: PaddedLogitsControls | None = None,
        logprobs: PaddedLogprobs | None = None, packed_logprobs: torch.Tensor | None = None,
        all_greedy: bool | None = None, grammar: PaddedVerifyGrammar | None = None,
    ) -> "LaunchedDecode":
        """Queue the copy of the tokens `batch` sampled (and of their packed logprobs) to the host
        (a graph's: later, in read); waits for nothing."""
        # One row per sequence (plain_decode): the batch's rows are the sequences' input positions
        # and the slots their K/V went to, as the batch computed them.
        positions, slots = batch.position_list, batch.slot_list
        values = token_ids if packed_logprobs is None else torch.cat([token_ids, packed_logprobs.reshape(-1)])
        copy = None if graphed else kind.copy_tokens(values)
        return cls(kind, seqs, positions, slots, token_ids, copy, graphed, controls, logprobs, all_greedy,
                   grammar=grammar)

    def launch_next(self, num_next_drafts: int | None = None) -> "LaunchedDecode | None":
        """The step after this one for the same sequences, its input tokens this one's (still on
        the device), when next_rows() allows it (no drafter: num_next_drafts is None; with
        zero_drafts_only, only while it is 0): advanced on the device when the graph's buffers
        still hold this step's inputs and its table covers every next position, else from inputs
        built on the host. After a step with a grammar, only the next step's forward is launched
        (its masks need this step's tokens on the host): complete() samples it after the read."""
        kind = self.kind
        grammar_step = self.pending is not None or self.grammar is not None
        self.complete()
        if grammar_step:
            return self.launch_forward_ahead()
        if kind.zero_drafts_only and num_next_drafts != 0:  # the next step drafts: the padded verify's
            return None
        graphs = kind.graphs
        if self.table_ends is not None and graphs.inputs_version == self.inputs_version:
            rows = next_rows(self, kind.block_size, kind.max_model_len, self.table_ends)
            if rows is not None:
                positions, slots = rows
                n = len(self.seqs)
                token_ids = graphs.advance_decode(self.graph_key, n, self.token_ids).greedy[:n]  # [n] int64
                return LaunchedDecode(kind, self.seqs, positions, slots, token_ids, None, True, all_greedy=True,
                                      graph_key=self.graph_key, inputs_version=graphs.inputs_version,
                                      table_ends=self.table_ends)
        rows = next_rows(self, kind.block_size, kind.max_model_len)
        if rows is None:
            return None
        batch = build_decode_batch(self.seqs, rows[0], self.token_ids, kind.block_size)
        return kind.launch_for(self.seqs, batch, self.controls, self.logprobs, self.all_greedy)

    def launch_forward_ahead(self) -> "LaunchedDecode | None":
        """The next step of a grammar step as its forward alone (pending: complete() masks and
        samples it), its inputs advanced on the device as a greedy step's are when the graph's
        buffers still hold this step's (any sampling: only the inputs move), else built on the
        host; None when next_rows() allows no next step."""
        kind, graphs, n = self.kind, self.kind.graphs, len(self.seqs)
        if self.table_ends is not None and graphs.inputs_version == self.inputs_version:
            rows = next_rows(self, kind.block_size, kind.max_model_len, self.table_ends)
            if rows is not None:
                positions, slots = rows
                raw_logits = graphs.advance_decode(self.graph_key, n, self.token_ids).logits[:n]  # [n, vocab]
                return LaunchedDecode(kind, self.seqs, positions, slots, None, None, False, self.controls,
                                      self.logprobs, self.all_greedy, graph_key=self.graph_key,
                                      inputs_version=graphs.inputs_version, table_ends=self.table_ends,
                                      pending=PendingGrammarSample(raw_logits, [p + 1 for p in positions]))
        rows = next_rows(self, kind.block_size, kind.max_model_len)
        if rows is None:
            return None
        batch = build_decode_batch(self.seqs, rows[0], self.token_ids, kind.block_size)
        _, _, raw_logits = kind.forward(batch)  # [n, vocab] float32 (a graph's: until its next replay)
        launched = LaunchedDecode(kind, self.seqs, batch.position_list, batch.slot_list, None, None, False,
                                  self.controls, self.logprobs, self.all_greedy,
                                  pending=PendingGrammarSample(raw_logits, batch.row_positions))
        launched.note_graph_inputs(batch)
        return launched

    def note_graph_inputs(self, batch: InputBatch) -> None:
        """After a grammar step's forward from host inputs: when it replayed a graph, the graph's
        key, inputs version and table ends, so the step after it may advance those inputs on the
        device (launch_forward_ahead)."""
        graphs = self.kind.graphs
        key = graphs.bucket_for(batch) if graphs is not None else None
        if key is not None:
            block_size = self.kind.block_size
            self.graph_key, self.inputs_version = key, graphs.inputs_version
            self.table_ends = [len(blocks) * block_size for blocks in batch.block_ids]

    def complete(self) -> None:
        """Mask and sample a grammar step queued as its forward alone (nothing for another step):
        the scheduler has taken it, so the host has the previous step's tokens and its matchers
        (their rows filled ahead on the worker since that read) give this step's masks."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        items = [ScheduledSequence(seq, 1, [], True) for seq in self.seqs]  # what matches() checked
        self.token_ids, self.grammar, packed = self.kind.sample(
            self.seqs, pending.row_positions, pending.raw_logits, self.controls, self.logprobs, self.all_greedy,
            items)
        values = self.token_ids if packed is None else torch.cat([self.token_ids, packed.reshape(-1)])
        self.copy = self.kind.copy_tokens(values)

    def read(self, following: "LaunchedDecode | None") -> list[SequenceResult]:
        """Wait for this step's tokens (only: not for the one queued after it).

        A graph's tokens are read from the next step's input buffer (the copy runs beside the
        graphs: CudaGraphRunner.download_input_ids) when that step went to the same graph, else
        copied now, before anything else can overwrite them."""
        self.complete()  # (a pending grammar step the pipeline did not queue past)
        if self.copy is None:
            if following is not None and following.graphed:  # the graph's inputs hold our tokens
                self.copy = HostCopy(*self.kind.graphs.download_input_ids(len(self.seqs)))
            else:
                self.copy = self.kind.copy_tokens(self.token_ids)
        host, n = self.copy.read(), len(self.seqs)
        results = [SequenceResult([token]) for token in (host if len(host) == n else host[:n])]
        if self.logprobs is not None:
            per_seq = read_padded_logprobs(self.logprobs, 1, host[n:], [r.new_token_ids for r in results])
            for result, logprobs in zip(results, per_seq):
                result.logprobs = logprobs
        if self.grammar is not None:  # the next step's rows, on the worker (the host step's call after sampling)
            self.grammar.structured.fill_ahead(self.grammar.items, results)
        return results

    def matches(self, scheduled: list[ScheduledSequence], block_size: int) -> bool:
        """Whether the scheduler's decision is this step: its sequences in order, one sampling row
        each at the launched position, over the same cache slot."""
        grammars = self.pending is not None  # a grammar step queued ahead takes grammar rows
        if len(scheduled) != len(self.seqs) or not plain_decode(scheduled, grammars=grammars):
            return False
        for item, seq, pos, slot in zip(scheduled, self.seqs, self.positions, self.slots):
            if item.seq is not seq or seq.num_computed_tokens != pos:
                return False
            blocks, index = seq.block_ids, pos // block_size
            if len(blocks) <= index or blocks[index] * block_size + pos % block_size != slot:  # cache_slot
                return False
        return True


def next_rows(launched: LaunchedDecode, block_size: int, max_model_len: int,
              table_ends: list[int] | None = None) -> tuple[list[int], list[int]] | None:
    """The positions and cache slots of the step after `launched`, or None when that step cannot
    be launched now: a sequence would stop at `launched`'s token whatever it is (max_tokens,
    max_model_len), or its next position lies in a block the scheduler has not allocated yet
    (or, with table_ends, past the first position table_ends gives for it)."""
    positions, slots = [], []
    ends = table_ends if table_ends is not None else launched.positions  # (not read without table_ends)
    for seq, pos, end in zip(launched.seqs, launched.positions, ends):
        nxt = pos + 1
        max_tokens = seq.sampling_params.max_tokens
        num_tokens = len(seq.token_ids)
        # The host has not appended `launched`'s token: that one brings the sequence to
        # num_tokens + 1 tokens and num_output_tokens + 1 outputs.
        if max_tokens is not None and num_tokens - len(seq.prompt_token_ids) + 1 >= max_tokens:
            return None
        blocks, index = seq.block_ids, nxt // block_size
        if num_tokens + 1 >= max_model_len or index >= len(blocks) or (table_ends is not None and nxt >= end):
            return None
        positions.append(nxt)
        slots.append(blocks[index] * block_size + nxt % block_size)  # cache_slot
    return positions, slots
