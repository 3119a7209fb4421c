"""ParallelExecutor and its workers (foretell/distributed/executor.py, worker.py) on 2 spawned gloo
ranks running a stand-in for the model runner: every call reaches every rank in order, rank 0's
answer comes back, errors are raised with the rank named, and a worker killed in the middle of a
step (its peer waiting for it in a collective) gives WorkerDied within seconds, never a hang.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from foretell.distributed.executor import ParallelExecutor, WorkerDied, WorkerFailed


class StandInRunner:
    """What a model runner does under tensor parallelism, reduced to its communication: each step
    every rank works on the same plan and the ranks meet in a collective."""

    def __init__(self, tp, device, tag: str):
        self.tp, self.device, self.tag = tp, device, tag
        self.calls: list[str] = []  # what this rank ran, in order

    def execute(self, plan: dict) -> dict:
        self.calls.append(f"execute {plan['step']}")
        mine = torch.tensor([[self.tp.rank, plan["step"], sum(plan["tokens"]), len(self.calls)]], dtype=torch.float64)
        every = self.tp.all_gather(mine, dim=0)  # [world_size, 4]: what each rank received
        return {"tag": self.tag, "seen": every.long().tolist(), "device": str(self.device)}

    def forget(self, seq_id: int) -> None:
        self.calls.append(f"forget {seq_id}")

    def history(self) -> list[list[str]]:
        every = [None] * self.tp.world_size
        import torch.distributed as dist

        dist.all_gather_object(every, self.calls)
        return every

    def check(self, raising_ranks: list[int]) -> str:
        if self.tp.rank in raising_ranks:
            raise ValueError(f"plan refused on rank {self.tp.rank}")
        self.tp.all_reduce(torch.ones(1))  # the ranks that did not raise wait here for the others
        return "checked"

    def slow_step(self, seconds: float) -> str:
        time.sleep(seconds)
        self.tp.all_reduce(torch.ones(1))
        return "done"


def build_stand_in(tp, device, tag: str) -> StandInRunner:
    torch.set_num_threads(1)
    return StandInRunner(tp, device, tag)


def build_failing_on_rank1(tp, device) -> StandInRunner:
    if tp.rank == 1:
        raise RuntimeError("no such model folder: /nowhere")
    return StandInRunner(tp, device, "unused")


@pytest.fixture(scope="module")
def executor():
    with ParallelExecutor(2, build_stand_in, ("t0",), backend="gloo", start_timeout_s=120) as executor:
        yield executor


def test_every_call_reaches_every_rank_in_order(executor):
    for step in range(3):
        plan = {"step": step, "tokens": list(range(step + 2))}
        answer = executor.call("execute", plan)
        assert answer["tag"] == "t0" and answer["device"] == "cpu"
        for rank, row in enumerate(answer["seen"]):
            assert row[:3] == [rank, step, sum(plan["tokens"])]
        executor.broadcast("forget", 100 + step)
    histories = executor.call("history")
    want = [item for step in range(3) for item in (f"execute {step}", f"forget {100 + step}")]
    assert histories[0][-6:] == want and histories[1][-6:] == want


def test_an_error_on_every_rank_is_raised_as_itself(executor):
    with pytest.raises(ValueError, match="plan refused on rank 0") as error:
        executor.call("check", [0, 1])
    assert any("worker rank 0" in note for note in getattr(error.value, "__notes__", []))
    assert executor.call("check", []) == "checked"  # still usable: every rank saw the same failure
    assert executor.call("execute", {"step": 9, "tokens": [1]})["seen"][1][:2] == [1, 9]


def test_an_unknown_world_size_is_refused():
    with pytest.raises(ValueError, match="world_size must be an integer >= 1, got 0"):
        ParallelExecutor(0, build_stand_in)


def test_a_worker_killed_mid_step_gives_an_error_within_seconds():
    executor = ParallelExecutor(2, build_stand_in, ("t1",), backend="gloo", start_timeout_s=120)
    try:
        assert executor.call("execute", {"step": 0, "tokens": [3]})["seen"][1][:3] == [1, 0, 3]
        victim = executor.pids[1]
        killed_at = []

        def kill():
            killed_at.append(time.monotonic())
            os.kill(victim, signal.SIGKILL)

        threading.Timer(0.5, kill).start()  # rank 0 is then inside slow_step's collective, waiting
        with pytest.raises(WorkerDied, match=rf"worker rank 1 \(pid {victim}\) was killed by signal 9"):
            executor.call("slow_step", 2.0)
        assert time.monotonic() - killed_at[0] < 5.0
        with pytest.raises(RuntimeError, match="shut down"):
            executor.call("execute", {"step": 1, "tokens": [3]})
        assert not any(process.is_alive() for process in executor.processes)  # rank 0 ended too
    finally:
        executor.shutdown(timeout_s=0.0)


def test_an_error_on_one_rank_fails_the_executor_without_a_hang():
    executor = ParallelExecutor(2, build_stand_in, ("t2",), backend="gloo", start_timeout_s=120, error_grace_s=1.0)
    try:
        start = time.monotonic()
        with pytest.raises(WorkerFailed, match=r"worker rank 1 raised in a call .*ranks that raised: \[1\]") as error:
            executor.call("check", [1])  # rank 0 waits in the all-reduce for rank 1, which raised first
        assert "plan refused on rank 1" in str(error.value)
        assert time.monotonic() - start < 10.0
        assert not any(process.is_alive() for process in executor.processes)
    finally:
        executor.shutdown(timeout_s=0.0)


@pytest.mark.slow
def test_a_worker_failing_to_start_is_named():
    with pytest.raises(RuntimeError, match=r"worker rank 1 of 2 could not start: no such model folder"):
        ParallelExecutor(2, build_failing_on_rank1, backend="gloo", start_timeout_s=120)
