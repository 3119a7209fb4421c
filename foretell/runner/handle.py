"""RunnerHandle: what the engine holds to run its steps, one interface for one device and for
several tensor-parallel ranks.

  runner = start_runner(config)   # ModelRunner (one device), or ParallelRunner (tensor_parallel_size
                                  # > 1: one worker process per rank, parallel_runner.py)
  facts = runner.describe()       # RunnerFacts: max_model_len, vocab_size, cache plan, ...
  results = runner.execute(sched) # per scheduled sequence; runner.last_times: the step's times
  runner.forget(seq_id); runner.abandon_step(seq_ids); runner.reset_pipeline(); runner.shutdown()
  runner.drop_cached_responses()  # after synthetic requests: the drafter keeps none of their responses
  runner.runner_stats()           # what the drafter and the step pipeline add to get_stats() (rank 0's)
  runner.replay_step_costs(max_k) # adaptive speculation's start-up step costs (None: not timed)

A ParallelRunner whose workers died or fell out of step raises one of RUNNER_LOST from execute():
the engine cannot go on without them and says so instead of failing requests one by one.
"""

from __future__ import annotations

from typing import Protocol

from foretell.config import EngineConfig
from foretell.engine.scheduler import SchedulerOutput
from foretell.runner.model_runner import ModelRunner, RunnerFacts, StepTimes
from foretell.runner.parallel_runner import RUNNER_LOST, ParallelRunner
from foretell.runner.sequence_result import SequenceResult

__all__ = ["RUNNER_LOST", "RunnerHandle", "start_runner"]


class RunnerHandle(Protocol):
    last_times: StepTimes

    def describe(self) -> RunnerFacts: ...

    def execute(self, sched: SchedulerOutput) -> list[SequenceResult]: ...

    def forget(self, seq_id: int) -> None: ...

    def abandon_step(self, seq_ids: list[int]) -> None: ...

    def reset_pipeline(self) -> None: ...

    def drop_cached_responses(self) -> None: ...

    def runner_stats(self) -> dict: ...

    def graph_state(self) -> dict: ...

    def replay_step_costs(self, max_k: int) -> dict[int, list[float]] | None: ...

    def shutdown(self) -> None: ...


def start_runner(config: EngineConfig) -> RunnerHandle:
    if config.parallel.tensor_parallel_size > 1:
        return ParallelRunner(config)
    return ModelRunner(config)
