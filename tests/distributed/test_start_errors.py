"""Start-up failures of tensor-parallel workers (foretell/distributed/executor.py, start_checks.py)
reach the caller as one clear error naming the rank and the cause, within seconds, never a hang:
an error on every rank, an error on one rank while the other waits in a collective, an exception
that does not pickle, a worker that exits while starting, ranks that disagree on their world or on
what they built; more ranks than GPUs; and, through the engine, a model whose heads do not divide
over the ranks.

The stand-in builds below do what a model runner's start-up does, reduced to its failure: they run
in 2 spawned gloo ranks (each start pays torch's import: a few seconds).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest
import torch

from foretell.distributed.executor import ParallelExecutor, WorkerDied, WorkerFailed
from foretell.distributed.start_checks import check_rank_devices, start_failure, world_mismatch

START_LIMIT_S = 30.0  # spawning 2 ranks on a busy 2-core machine, then the error: seconds, not minutes


class Built:
    def __init__(self, tp):
        self.tp = tp


def build_raising_on_every_rank(tp, device):
    raise ValueError(f"config.json: tensor_parallel_size = {tp.world_size} does not divide num_attention_heads = 3")


def build_raising_on_rank1_while_rank0_waits(tp, device):
    if tp.rank == 1:
        time.sleep(0.5)  # rank 0 is then inside the collective, waiting for rank 1
        raise RuntimeError(f"no such model folder: /nowhere (raised at {time.time():.3f})")
    tp.all_reduce(torch.ones(1))  # never completes: rank 1 does not come
    return Built(tp)


class Unpicklable(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.callback = lambda: None  # pickling this exception fails


def build_raising_unpicklable_on_rank1(tp, device):
    if tp.rank == 1:
        raise Unpicklable("the loader's own exception")
    tp.all_reduce(torch.ones(1))
    return Built(tp)


def build_exiting_on_rank1(tp, device):
    if tp.rank == 1:
        time.sleep(0.5)
        os._exit(3)  # e.g. the out-of-memory killer while loading weights
    tp.all_reduce(torch.ones(1))
    return Built(tp)


def build_plain(tp, device):
    return Built(tp)


def facts_differing_by_rank(built: Built) -> dict:
    return {"max_model_len": 128 + 64 * built.tp.rank, "vocab_size": 512}


def facts_same_on_every_rank(built: Built) -> dict:
    return {"max_model_len": 128, "vocab_size": 512}


def start(build, **options) -> ParallelExecutor:
    return ParallelExecutor(2, build, backend="gloo", start_timeout_s=120, **options)


def assert_workers_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    for pid in pids:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            try:  # a dead child not yet reaped still answers kill(pid, 0)
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    break
            except ChildProcessError:
                break
            assert time.monotonic() < deadline, f"worker {pid} still runs after the start-up error"
            time.sleep(0.1)


# ------------------------------------------------------------------------- through workers


@pytest.mark.slow
def test_an_error_on_every_rank_is_the_workers_own_type_naming_the_rank():
    began = time.monotonic()
    with pytest.raises(ValueError) as error:
        start(build_raising_on_every_rank)
    assert time.monotonic() - began < START_LIMIT_S
    message = str(error.value)
    assert message.startswith("tensor-parallel worker rank 0 of 2 could not start (rank 1 too): config.json: "
                              "tensor_parallel_size = 2 does not divide num_attention_heads = 3")
    assert any("build_raising_on_every_rank" in note for note in error.value.__notes__)  # the worker's traceback


def test_an_error_on_one_rank_while_the_other_waits_in_a_collective():
    """Rank 1's error, not rank 0's broken collective, and within seconds of rank 1 raising."""
    with pytest.raises(RuntimeError) as error:
        start(build_raising_on_rank1_while_rank0_waits)
    assert type(error.value) is RuntimeError  # the worker's type, not WorkerFailed
    match = re.fullmatch(r"tensor-parallel worker rank 1 of 2 could not start: no such model folder: /nowhere "
                         r"\(raised at ([0-9.]+)\)", str(error.value))
    assert match, str(error.value)
    assert time.time() - float(match.group(1)) < 5.0


@pytest.mark.slow
def test_an_exception_that_does_not_pickle_becomes_worker_failed_with_its_text():
    with pytest.raises(WorkerFailed, match=r"worker rank 1 of 2 could not start \(ranks that failed: \[1\]\): "
                                           r".*Unpicklable: the loader's own exception") as error:
        start(build_raising_unpicklable_on_rank1)
    assert any("Traceback" in note for note in error.value.__notes__)


@pytest.mark.slow
def test_a_worker_exiting_while_starting_is_named():
    began = time.monotonic()
    with pytest.raises(WorkerDied, match=r"worker rank 1 \(pid \d+\) exited with code 3 while starting"):
        start(build_exiting_on_rank1)
    assert time.monotonic() - began < START_LIMIT_S


@pytest.mark.slow
def test_ranks_that_built_different_engines_are_refused_and_stopped():
    with pytest.raises(WorkerFailed, match=r"worker rank 1 disagrees with rank 0 on max_model_len: 192 vs 128"):
        start(build_plain, world_facts=facts_differing_by_rank)


@pytest.mark.slow
def test_ranks_that_agree_start():
    with start(build_plain, world_facts=facts_same_on_every_rank) as executor:
        assert executor.started and len(executor.pids) == 2
    assert_workers_gone(executor.pids)


# ---------------------------------------------------------------------- the checks alone


def report(rank: int, world_size: int = 2, **facts) -> dict:
    return {"group_world_size": world_size, "group_rank": rank, "torch_version": "2.x", **facts}


def test_world_mismatch_names_the_rank_and_what_differs():
    assert world_mismatch({0: report(0, vocab=8), 1: report(1, vocab=8)}, 2) is None
    assert "rank 1 joined a group of 3 ranks, but the engine started 2" in world_mismatch(
        {0: report(0), 1: report(1, world_size=3)}, 2)
    assert "rank 1 holds rank 0 in its group" in world_mismatch({0: report(0), 1: report(0)}, 2)
    assert "rank 1 disagrees with rank 0 on vocab: 9 vs 8" in world_mismatch(
        {0: report(0, vocab=8), 1: report(1, vocab=9)}, 2)
    assert "on torch_version" in world_mismatch({0: report(0), 1: {**report(1), "torch_version": "2.y"}}, 2)


def test_start_failure_keeps_the_type_or_gives_up():
    rebuilt = start_failure(1, 2, [1], FileNotFoundError("no config.json in /nowhere"), "Traceback ...")
    assert type(rebuilt) is FileNotFoundError
    assert str(rebuilt) == "tensor-parallel worker rank 1 of 2 could not start: no config.json in /nowhere"
    assert start_failure(0, 2, [0], KeyError("model_type"), "...") is None  # str() quotes it: not rebuilt
    assert start_failure(0, 2, [0], None, "...") is None  # did not pickle


def test_more_ranks_than_gpus_and_a_named_gpu_are_refused():
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 needs 4 GPUs \(one per rank\); 2 are visible"):
        check_rank_devices(4, cuda, num_gpus=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 GPUs \(one per rank\); 1 is visible"):
        check_rank_devices(2, cuda, num_gpus=1)
    with pytest.raises(ValueError, match="device cuda:1 with tensor_parallel_size=2: rank r runs on cuda:r"):
        check_rank_devices(2, torch.device("cuda", 1), num_gpus=8)
    check_rank_devices(2, cuda, num_gpus=2)
    check_rank_devices(2, torch.device("cuda", 0), num_gpus=8)
    check_rank_devices(8, torch.device("cpu"), num_gpus=0)  # CPU ranks share the cores


def test_the_engine_refuses_more_ranks_than_gpus_before_starting_workers(monkeypatch, qwen3_checkpoint):
    """The front process's check: no worker is spawned (monkeypatched device count, CPU-only CI)."""
    from foretell.config import EngineConfig, ModelConfig, ParallelConfig
    from foretell.runner import parallel_runner

    monkeypatch.setattr(ModelConfig, "resolve_device", lambda self: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    spawned = []
    monkeypatch.setattr(parallel_runner, "ParallelExecutor", lambda *a, **k: spawned.append(a))
    config = EngineConfig(model=ModelConfig(model=qwen3_checkpoint), parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        parallel_runner.ParallelRunner(config)
    assert spawned == []


# --------------------------------------------------------------------------- the engine


def test_the_engine_names_the_rank_when_heads_do_not_divide(qwen3_checkpoint, tmp_path):
    """A Qwen3 checkpoint with 3 attention heads on 2 ranks: the workers' divisibility check
    reaches LLM() as a ValueError naming the rank, the config file and the field, in seconds."""
    from foretell import LLM

    folder = tmp_path / "qwen3_three_heads"
    shutil.copytree(qwen3_checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_attention_heads"] = 3
    (folder / "config.json").write_text(json.dumps(config))
    began = time.monotonic()
    with pytest.raises(ValueError, match=r"tensor-parallel worker rank 0 of 2 could not start \(rank 1 too\): "
                                         r".*config\.json: tensor_parallel_size = 2 does not divide "
                                         r"num_attention_heads = 3"):
        LLM(str(folder), dtype="float32", tensor_parallel_size=2, num_kv_blocks=16)
    assert time.monotonic() - began < 60
