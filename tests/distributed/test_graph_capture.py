"""Whether a tensor-parallel rank captures CUDA graphs and queues steps ahead
(foretell/distributed/graph_capture.py): NCCL ranks may (their collectives are captured with the
forward), gloo ranks and CPU ranks may not, one rank follows the one-device rules; the decision
reads the backend of the rank's real group, and a 2-rank gloo runner stays eager with nothing
queued ahead. (The NCCL path itself runs in scripts/check_tp_gpu.py on a 2-GPU machine.)
"""

from __future__ import annotations

import torch

from foretell.distributed.graph_capture import graph_capture_decision, group_backend
from foretell.distributed.tensor_parallel import TensorParallel
from fixtures.tensor_parallel import fake_rank

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_one_rank_follows_the_one_device_rules():
    for device in (CUDA, CPU):
        decision = graph_capture_decision(TensorParallel(), device)
        assert decision.allowed and "one rank" in decision.reason


def test_nccl_ranks_capture_and_gloo_ranks_stay_eager():
    rank = fake_rank(1, 2)
    nccl = graph_capture_decision(rank, CUDA, backend="nccl")
    assert nccl.allowed and "collectives are captured" in nccl.reason
    gloo = graph_capture_decision(rank, CUDA, backend="gloo")
    assert not gloo.allowed and "over gloo" in gloo.reason and "eagerly" in gloo.reason
    cpu = graph_capture_decision(rank, CPU, backend="gloo")
    assert not cpu.allowed and "on cpu" in cpu.reason
    assert not graph_capture_decision(rank, CPU, backend="NCCL").allowed  # no CUDA graphs off CUDA


def decide_in_rank(tp):
    return group_backend(tp), graph_capture_decision(tp, torch.device("cpu"))


def test_the_decision_reads_the_groups_backend(tp_ranks):
    for backend, decision in tp_ranks.run(decide_in_rank):
        assert backend == "gloo" and not decision.allowed and "on cpu" in decision.reason
    assert group_backend(TensorParallel()) is None


def runner_choices(tp, checkpoint):
    from foretell.config import EngineConfig, ModelConfig, SchedulerConfig
    from foretell.runner.model_runner import ModelRunner

    config = EngineConfig(model=ModelConfig(model=checkpoint, dtype="float32"),
                          scheduler=SchedulerConfig(async_scheduling="on"))
    runner = ModelRunner(config, tp, torch.device("cpu"))
    return runner.graph_decision.allowed, runner.graphs is None, runner.pipeline.queue_ahead


def test_a_gloo_runner_stays_eager_and_queues_nothing_ahead(tp_ranks, llama31_checkpoint):
    """async_scheduling on asks for queued-ahead steps; the gloo ranks refuse them."""
    assert tp_ranks.run(runner_choices, llama31_checkpoint) == [(False, True, False)] * 2
