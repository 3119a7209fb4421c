"""The runner under tensor parallelism: one ModelRunner per rank, each in its own worker process,
driven from the engine's process through a ParallelExecutor (foretell/distributed/executor.py).

  front process (engine)                    worker process, rank r (cuda:r or the CPU)
  ParallelRunner.execute(sched)  -- call -> RankRunner.execute(plan) -> ModelRunner.execute
     PlanEncoder.encode(sched) = plan          SequenceMirrors.apply(plan) = sched
                                 <- rank 0's (results, step times)
  ParallelRunner.forget(seq_id)  -- broadcast (no answer awaited): the rank drops its mirror

Each step sends a StepPlan (step_plan.py), not the scheduler's Sequences: per sequence only what
changed since its last step, so a decode step's plan does not grow with the sequence's length;
each rank keeps a mirror Sequence per live sequence.

Every rank gets every call in the same order and computes the same tokens (the target's logits
come out whole on every rank, the noise seed is shared, drafters run on every rank), so rank 0's
results are the step's. ParallelRunner offers the engine what a local ModelRunner does (handle.py:
RunnerHandle): describe(), execute(), forget(), abandon_step(), reset_pipeline(),
drop_cached_responses(), last_times, shutdown(). A worker that dies or fails on some ranks only
raises WorkerDied / WorkerFailed from the executor; the runner is lost from then on (execute raises
the same error again; forget and abandon_step have nothing left to drop).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from foretell.config import EngineConfig
from foretell.distributed.executor import ParallelExecutor, WorkerDied, WorkerFailed
from foretell.distributed.start_checks import check_rank_devices
from foretell.distributed.tensor_parallel import TensorParallel
from foretell.engine.scheduler import SchedulerOutput
from foretell.runner.model_runner import ModelRunner, RunnerFacts, StepTimes
from foretell.runner.sequence_result import SequenceResult
from foretell.runner.step_plan import PlanEncoder, SequenceMirrors, StepPlan

RUNNER_LOST = (WorkerDied, WorkerFailed)


class RankRunner:
    """One rank's side: the calls the front process makes, on this rank's ModelRunner."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.mirrors = SequenceMirrors()

    def describe(self) -> RunnerFacts:
        return self.runner.describe()

    def execute(self, plan: StepPlan) -> tuple[list[SequenceResult], StepTimes]:
        results = self.runner.execute(self.mirrors.apply(plan))
        return results, self.runner.last_times

    def forget(self, seq_id: int) -> None:
        self.mirrors.forget(seq_id)
        self.runner.forget(seq_id)

    def num_logit_gathers(self) -> int:
        return self.runner.num_logit_gathers()

    def abandon_step(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:  # resent whole next time: the failure may have left them half-applied
            self.mirrors.forget(seq_id)
        self.runner.abandon_step(seq_ids)

    def reset_pipeline(self) -> None:
        self.runner.reset_pipeline()

    def drop_cached_responses(self) -> None:
        self.runner.drop_cached_responses()

    def runner_stats(self) -> dict:
        return self.runner.runner_stats()

    def graph_state(self) -> dict:
        return self.runner.graph_state()


def build_rank_runner(tp: TensorParallel, device: torch.device, config: EngineConfig) -> RankRunner:
    """The worker's build function (run in each rank's process). On the CPU, without
    num_cpu_threads, the ranks share the cores: each takes its part of them."""
    if device.type == "cpu" and config.model.num_cpu_threads is None:
        torch.set_num_threads(max(1, torch.get_num_threads() // tp.world_size))
    return RankRunner(ModelRunner(config, tp, device))


def rank_runner_facts(rank_runner: RankRunner) -> dict:
    """What every rank must agree on once built (the executor compares them): the runner's
    facts but its device, which names the rank's own."""
    facts = dataclasses.asdict(rank_runner.describe())
    facts.pop("device")
    return facts


class ParallelRunner:
    """The front process's handle on tensor_parallel_size ranks."""

    def __init__(self, config: EngineConfig):
        world_size = config.parallel.tensor_parallel_size
        device = config.model.resolve_device()
        check_rank_devices(world_size, device, torch.cuda.device_count() if device.type == "cuda" else 0)
        self.executor = ParallelExecutor(world_size, build_rank_runner, (config,), device_type=device.type,
                                         world_facts=rank_runner_facts)
        # Workers stop with this object even when the engine is never shut down explicitly.
        self._finalizer = weakref.finalize(self, self.executor.shutdown)
        self.lost: BaseException | None = None
        self.plans = PlanEncoder()
        facts = self._call("describe")
        self.facts = facts
        self.max_model_len = facts.max_model_len
        self.vocab_size = facts.vocab_size
        self.device = facts.device
        self.dtype = facts.dtype
        self.last_times = StepTimes()

    def describe(self) -> RunnerFacts:
        return self.facts

    def execute(self, sched: SchedulerOutput) -> list[SequenceResult]:
        results, self.last_times = self._call("execute", self.plans.encode(sched))
        return results

    def forget(self, seq_id: int) -> None:
        self.plans.forget(seq_id)
        self._broadcast("forget", seq_id)

    def num_logit_gathers(self) -> int:
        """Rank 0's count of whole-logits gathers (ModelRunner.num_logit_gathers)."""
        return self._call("num_logit_gathers")

    def graph_state(self) -> dict:
        """Rank 0's RankRunner.graph_state (every rank decides alike)."""
        return self._call("graph_state")

    def abandon_step(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.plans.forget(seq_id)
        self._broadcast("abandon_step", seq_ids)

    def reset_pipeline(self) -> None:
        self._broadcast("reset_pipeline")

    def drop_cached_responses(self) -> None:
        self._broadcast("drop_cached_responses")

    def runner_stats(self) -> dict:
        """Rank 0's runner stats (ModelRunner.runner_stats)."""
        return self._call("runner_stats")

    def replay_step_costs(self, max_k: int) -> None:
        """Not timed under tensor parallelism (runner/startup_costs.py): costs learned from steps."""
        return None

    def shutdown(self) -> None:
        self._finalizer()

    def _call(self, method: str, *args):
        if self.lost is not None:
            raise type(self.lost)(str(self.lost))
        try:
            return self.executor.call(method, *args)
        except RUNNER_LOST as error:
            self.lost = error
            raise

    def _broadcast(self, method: str, *args) -> None:
        if self.lost is not None:  # the workers are gone, and their state with them
            return
        try:
            self.executor.broadcast(method, *args)
        except RUNNER_LOST as error:
            self.lost = error
