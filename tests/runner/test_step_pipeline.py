"""The step pipeline (runner/step_pipeline.py) on its own, with stand-in steps: a queued step is
used only when the scheduler's decision matches it and dropped otherwise; finishing a step queues
its follower only when the pipeline queues ahead and the step can be followed, before the step is
read; the counts add up; drop() and reset() leave nothing queued."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from foretell.runner.sequence_result import SequenceResult
from foretell.runner.step_pipeline import HostCopy, StepPipeline


@dataclass
class FakeStep:
    name: str
    log: list
    followable: bool = True
    expected: list = field(default_factory=list)  # the scheduled list matches() accepts

    def matches(self, scheduled, block_size):
        return scheduled == self.expected

    def launch_next(self, num_next_drafts=None):
        self.log.append(("launch_next", self.name))
        if not self.followable:
            return None
        return FakeStep(self.name + "+", self.log, expected=["next"])

    def read(self, following):
        self.log.append(("read", self.name, following.name if following else None))
        return [SequenceResult(new_token_ids=[len(self.name)])]


@dataclass
class FakeKind:
    accepts: str
    log: list

    def launch(self, sched, batch):
        return FakeStep(self.accepts, self.log) if batch == self.accepts else None


def test_a_queued_step_is_used_only_when_the_decision_matches():
    log = []
    pipeline = StepPipeline(True, [FakeKind("decode", log)])
    first = pipeline.launch(None, "decode")
    assert first is not None and pipeline.launch(None, "prefill") is None
    assert pipeline.finish(first)[0].new_token_ids == [6]
    # The follower was launched before this step was read, and knows what follows it.
    assert log == [("launch_next", "decode"), ("read", "decode", "decode+")]
    assert pipeline.queued is not None and pipeline.num_launched == 1 and pipeline.num_used == 0

    assert pipeline.take(["something else"], 16) is None  # a different decision drops it
    assert pipeline.queued is None and pipeline.num_used == 0

    pipeline.finish(pipeline.launch(None, "decode"))
    taken = pipeline.take(["next"], 16)
    assert taken is not None and taken.name == "decode+" and pipeline.queued is None
    assert pipeline.num_launched == 2 and pipeline.num_used == 1


def test_nothing_is_queued_when_not_queueing_ahead_or_not_followable():
    log = []
    pipeline = StepPipeline(False, [FakeKind("verify", log)])
    pipeline.finish(pipeline.launch(None, "verify"))
    assert log == [("read", "verify", None)] and pipeline.queued is None and pipeline.num_launched == 0

    pipeline = StepPipeline(True, [])
    assert pipeline.launch(None, "verify") is None  # no kind: the general path
    step = FakeStep("last", log, followable=False)
    pipeline.finish(step)
    assert pipeline.queued is None and pipeline.num_launched == 0


def test_the_first_fitting_kind_launches():
    log = []
    pipeline = StepPipeline(True, [FakeKind("a", log), FakeKind("b", log)])
    assert pipeline.launch(None, "b").name == "b"


def test_drop_and_reset():
    log = []
    pipeline = StepPipeline(True, [FakeKind("decode", log)])
    pipeline.finish(pipeline.launch(None, "decode"))
    pipeline.drop()
    assert pipeline.queued is None and pipeline.num_launched == 1
    pipeline.finish(pipeline.launch(None, "decode"))
    pipeline.take(["next"], 16)
    pipeline.reset()
    assert pipeline.queued is None and pipeline.num_launched == pipeline.num_used == 0


def test_host_copy_off_cuda_reads_the_tensor():
    values = torch.tensor([3, 1, 4])
    copy = HostCopy.queue(values)
    assert copy.ready is None and copy.read() == [3, 1, 4]
