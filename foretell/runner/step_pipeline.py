"""The step pipeline: the one owner of the step queued ahead (asynchronous scheduling).

A device step (a plain decode step, runner/decode_ahead.py; a padded verify step,
runner/graphed_verify.py) leaves everything the step after it needs on the device. With
`queue_ahead` on, finishing a step first queues that next step on the device, then waits for its
own results, so the host's work between two steps (the engine's postprocess and schedule, the next
batch's inputs) runs while the device computes. The next execute() takes the queued step when the
scheduler's decision is exactly that step (`matches`), and drops it otherwise; why dropping is
safe: decode_ahead.py.

The pipeline holds the state that used to be spread over the runner: the queued step, and the
counts of steps queued ahead and used. It knows the kinds of device step only through the two
small protocols below (StepKind launches one for a batch, QueuedStep is one on its way), so the
step files import this one and not the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from foretell.engine.scheduler import ScheduledSequence, SchedulerOutput
from foretell.runner.input_batch import InputBatch
from foretell.runner.pinned_ring import PinnedRing, RingSlot
from foretell.runner.sequence_result import SequenceResult


@dataclass
class HostCopy:
    """A device tensor's copy to host memory, queued on the stream; read() waits for it alone,
    not for work queued after it."""

    host: torch.Tensor  # pinned on CUDA; the tensor itself off CUDA
    ready: "torch.cuda.Event | None"
    slot: RingSlot | None = None  # the ring slot `host` and `ready` belong to, when from a ring

    @classmethod
    def queue(cls, values: torch.Tensor, ring: PinnedRing | None = None) -> "HostCopy":
        """values [n] copied to the host: into the next slot of `ring` (its buffer and event,
        reused: no allocation per step) when given, else into a new pinned tensor."""
        if values.device.type != "cuda":
            return cls(values, None)
        if ring is not None:
            host, ready, slot = ring.take(values.numel())
            host = host.view(values.shape)
        else:
            host, ready, slot = torch.empty(values.shape, dtype=values.dtype, pin_memory=True), torch.cuda.Event(), None
        host.copy_(values, non_blocking=True)
        ready.record()
        return cls(host, ready, slot)

    def read(self) -> list:
        if self.ready is not None:
            self.ready.synchronize()
        if self.slot is not None:
            self.slot.check()
        return self.host.tolist()


class QueuedStep(Protocol):
    """A step launched on the device whose results the host has not read yet. drafter_rows: its
    target rows for a drafter that catches up over them after the read (a hybrid's: host_drafts.py's
    DrafterRows), None for every other step."""

    drafter_rows: Any

    def matches(self, scheduled: list[ScheduledSequence], block_size: int) -> bool:
        """Whether the scheduler's decision is exactly this step."""
        ...

    def launch_next(self, num_next_drafts: int | None = None) -> "QueuedStep | None":
        """Queue the step after this one on the device, before this one is read, when it can be
        queued whatever this one's results are; None when it cannot. num_next_drafts: the
        scheduler's choice of drafts for that step (adaptive speculation; None: all)."""
        ...

    def read(self, following: "QueuedStep | None") -> list[SequenceResult]:
        """Wait for this step's results (not for `following`, queued after it) and return them;
        `following` learns from them what it computes."""
        ...


class StepKind(Protocol):
    """A kind of device step: launches it for a batch it fits, else returns None."""

    def launch(self, sched: SchedulerOutput, batch: InputBatch) -> QueuedStep | None: ...


class StepPipeline:
    def __init__(self, queue_ahead: bool, kinds: list[StepKind]):
        self.queue_ahead = queue_ahead  # queue the step after a device step before reading it
        self.kinds = kinds  # tried in order for a batch no queued step covers
        self.queued: QueuedStep | None = None  # the step queued ahead by the last one
        self.num_launched = 0  # steps queued ahead
        self.num_used = 0  # ... and how many of them the scheduler's decision matched

    def take(self, scheduled: list[ScheduledSequence], block_size: int) -> QueuedStep | None:
        """The queued step when the scheduler's decision is that step; it is dropped otherwise."""
        queued, self.queued = self.queued, None
        if queued is None or not queued.matches(scheduled, block_size):
            return None
        self.num_used += 1
        return queued

    def launch(self, sched: SchedulerOutput, batch: InputBatch) -> QueuedStep | None:
        """The batch as a device step, launched, when one kind fits it; None: the general path."""
        for kind in self.kinds:
            step = kind.launch(sched, batch)
            if step is not None:
                return step
        return None

    def finish(self, step: QueuedStep, num_next_drafts: int | None = None,
               queue_next: bool = True) -> list[SequenceResult]:
        """Queue the step after `step` when the pipeline may and can (and queue_next: not for a
        part of a split batch, split_step.py), then read `step`. num_next_drafts: the drafts the
        scheduler chose for the step after (SchedulerOutput's)."""
        following = step.launch_next(num_next_drafts) if self.queue_ahead and queue_next else None
        results = step.read(following)
        if following is not None:
            self.queued = following
            self.num_launched += 1
        return results

    def drop(self) -> None:
        """Forget the queued step (a failed step: the queued one assumed its results)."""
        self.queued = None

    def reset(self) -> None:
        """No queued step and fresh counts (after the warm-up's dummy requests)."""
        self.queued = None
        self.num_launched = self.num_used = 0
