"""Decoding one step ahead (asynchronous scheduling): step N + 1's forward is queued on the GPU
before the host reads step N's tokens, so the host's work between two steps (the engine's
postprocess and schedule, the next batch's tensors) runs while the GPU computes, not between.

A plain decode step (every sequence feeds one row and samples; no drafts, no logprobs) samples on
the device and queues the copy of its tokens to pinned host memory. Before waiting for that copy,
the runner launches the next step for the same sequences: the sampled tokens, still on the device,
are its inputs and every position moves one on. When the scheduler's next decision is exactly that
batch (the same sequences in the same order, one row each at the expected position), the runner
hands back the launched step's tokens instead of running the step; otherwise it drops the launch.

Dropping is safe. The dropped step wrote each sequence's K/V at the slot of its next position, in
a block the sequence held at launch and past its computed tokens: nothing reads a slot there before
the sequence writes it again (the same token at the same position when it continues). If the block
was freed meanwhile (the sequence finished, was aborted or preempted), the stale write precedes in
stream order every write of the block's next owner. Blocks in the prefix cache are never written:
the slot lies in the sequence's last, not yet full, block (a launch needs that block allocated).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foretell.engine.scheduler import ScheduledSequence
from foretell.engine.sequence import Sequence
from foretell.layers.sampler import SamplingBatch, row_seed
from foretell.runner.input_batch import InputBatch, build_decode_batch, cache_slot
from foretell.runner.sequence_result import SequenceResult


@dataclass
class HostCopy:
    """A device tensor's copy to host memory, queued on the stream; read() waits for it alone,
    not for work queued after it."""

    host: torch.Tensor  # pinned on CUDA; the tensor itself off CUDA
    ready: "torch.cuda.Event | None"

    @classmethod
    def queue(cls, values: torch.Tensor) -> "HostCopy":
        if values.device.type != "cuda":
            return cls(values, None)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(host, ready)

    def read(self) -> list:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def plain_decode(scheduled: list[ScheduledSequence]) -> bool:
    """Every sequence feeds one row, samples, carries no drafts and asks for no logprobs.

    A queued step samples before the host has appended the previous token, which is exact
    because sampling reads only the row's parameters and position (seeds), never the tokens
    generated so far: a sampling option that did (repetition penalties, min_tokens) would have to
    keep its requests out of this path."""
    return all(
        item.num_new_tokens == 1
        and item.samples
        and not item.draft_token_ids
        and item.seq.sampling_params.logprobs is None
        for item in scheduled
    )


@dataclass
class LaunchedDecode:
    """A decode step queued on the device whose tokens the host has not read yet."""

    seqs: list[Sequence]
    positions: list[int]  # per sequence: the position of the step's input token
    slots: list[int]  # per sequence: the cache slot the step wrote its K/V to
    token_ids: torch.Tensor  # [num_seqs] int64 on the device: what the step sampled
    copy: HostCopy | None  # of token_ids; None: a graph's argmax, copied once the next step is queued
    graphed: bool  # token_ids is a CUDA graph's argmax output (the next replay overwrites it)

    @classmethod
    def queue(
        cls, seqs: list[Sequence], batch: InputBatch, token_ids: torch.Tensor, graphed: bool = False
    ) -> "LaunchedDecode":
        """Queue the copy of the tokens `batch` sampled to the host (a graph's: later, in finish);
        waits for nothing."""
        positions = [p - 1 for p in batch.row_positions]  # a row predicts its position + 1
        block_size = batch.block_size
        slots = [cache_slot(seq.block_ids, p, block_size) for seq, p in zip(seqs, positions)]
        copy = None if graphed else HostCopy.queue(token_ids)
        return cls(seqs, positions, slots, token_ids, copy, graphed)

    def finish(self, runner) -> list[SequenceResult]:
        """Queue the step after this one for the same sequences when it can be, then wait for
        this step's tokens (only: not for the one just queued) while the GPU runs the next.

        A graph's tokens are read from the next step's input buffer (the copy runs beside the
        graphs: CudaGraphRunner.download_input_ids) when that step went to the same graph, else
        copied now, before anything else can overwrite them."""
        block_size = runner.cache_plan.block_size
        positions = next_positions(self, block_size, runner.max_model_len)
        following = None
        if positions is not None:
            batch = build_decode_batch(self.seqs, positions, self.token_ids, block_size)
            following = runner.launched = launch_decode(runner, self.seqs, batch)
            runner.ahead_launched += 1
        if self.copy is None:
            if following is not None and following.graphed:  # the graph's inputs hold our tokens
                self.copy = HostCopy(*runner.graphs.download_input_ids(len(self.seqs)))
            else:
                self.copy = HostCopy.queue(self.token_ids)
        return [SequenceResult(new_token_ids=[token]) for token in self.copy.read()]

    def matches(self, scheduled: list[ScheduledSequence], block_size: int) -> bool:
        """Whether the scheduler's decision is this step: its sequences in order, one sampling row
        each at the launched position, over the same cache slot."""
        if len(scheduled) != len(self.seqs) or not plain_decode(scheduled):
            return False
        for item, seq, pos, slot in zip(scheduled, self.seqs, self.positions, self.slots):
            if item.seq is not seq or seq.num_computed_tokens != pos:
                return False
            if len(seq.block_ids) <= pos // block_size or cache_slot(seq.block_ids, pos, block_size) != slot:
                return False
        return True


def launch_decode(runner, seqs: list[Sequence], batch: InputBatch) -> LaunchedDecode:
    """Forward and sampling of a plain decode batch; the copy of its tokens to the host is
    queued, nothing is waited for. A greedy batch on a CUDA graph takes the graph's own argmax."""
    seeds = [
        None if seq.sampling_params.seed is None else row_seed(seq.sampling_params.seed, seq.index, pos)
        for seq, pos in zip(seqs, batch.row_positions)
    ]
    sampling = SamplingBatch.build([seq.sampling_params for seq in seqs], seeds, runner.vocab_size, runner.device)
    key = runner.graphs.bucket_for(batch) if runner.graphs is not None else None
    if key is not None and sampling.all_greedy:
        token_ids = runner.graphs.run(batch, key).greedy[: len(seqs)]  # [num_seqs] int64, until the next replay
        return LaunchedDecode.queue(seqs, batch, token_ids, graphed=True)
    _, _, logits = runner.target_forward(batch)
    token_ids = runner.sampler(logits, sampling).token_ids  # [num_seqs] int64
    return LaunchedDecode.queue(seqs, batch, token_ids)


def next_positions(launched: LaunchedDecode, block_size: int, max_model_len: int) -> list[int] | None:
    """The positions of the step after `launched`, or None when that step cannot be launched
    now: a sequence would stop at `launched`'s token whatever it is (max_tokens, max_model_len),
    or its next position lies in a block the scheduler has not allocated yet."""
    positions = []
    for seq, pos in zip(launched.seqs, launched.positions):
        nxt = pos + 1
        max_tokens = seq.sampling_params.max_tokens
        # The host has not appended `launched`'s token: that one brings the sequence to
        # num_tokens + 1 tokens and num_output_tokens + 1 outputs.
        if max_tokens is not None and seq.num_output_tokens + 1 >= max_tokens:
            return None
        if seq.num_tokens + 1 >= max_model_len or nxt // block_size >= len(seq.block_ids):
            return None
        positions.append(nxt)
    return positions
