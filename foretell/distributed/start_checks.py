"""What the front process checks before and while tensor-parallel workers start, so that every
start-up failure reaches the user as one clear error naming the rank and the cause:

  check_rank_devices(world_size, device, num_gpus)   before any worker starts: one GPU per rank,
                                                      rank r on cuda:r
  group_facts(tp, world_size, rank)                   in each worker, once it joined its group:
                                                      the size and rank the group itself reports
  world_mismatch(reports, world_size)                 in the front, once every rank built: the
                                                      ranks agree on their world and on what they
                                                      built (a message, or None)
  start_failure(rank, world_size, failed, error, text)
                                                      the exception a worker's start-up error
                                                      becomes in the front process

Imports nothing of the package above distributed/.
"""

from __future__ import annotations

from typing import Any

import torch

# Report keys the ranks must not share: each rank's own place in the group.
PER_RANK_KEYS = ("group_rank",)


def check_rank_devices(world_size: int, device: torch.device, num_gpus: int) -> None:
    """Tensor parallelism on GPUs puts rank r on cuda:r: there must be a GPU per rank, and a
    device naming another GPU than cuda:0 cannot be honoured (choose the GPUs with
    CUDA_VISIBLE_DEVICES instead). Nothing to check on the CPU (the ranks share its cores)."""
    if world_size == 1 or device.type != "cuda":
        return
    if num_gpus < world_size:
        raise ValueError(
            f"tensor_parallel_size={world_size} needs {world_size} GPUs (one per rank); "
            f"{num_gpus} {'is' if num_gpus == 1 else 'are'} visible: lower tensor_parallel_size "
            f"or run on a machine with more GPUs"
        )
    if device.index not in (None, 0):
        raise ValueError(
            f"device {device} with tensor_parallel_size={world_size}: rank r runs on cuda:r, "
            f"so the device must be cuda (or auto); choose which GPUs the ranks see with "
            f"CUDA_VISIBLE_DEVICES"
        )


def group_facts(tp: Any, world_size: int, rank: int) -> dict[str, Any]:
    """The world as this worker's process group reports it (tp: its TensorParallel)."""
    facts = {"group_world_size": world_size if not tp.is_parallel else None, "group_rank": rank,
             "torch_version": torch.__version__}
    if tp.is_parallel:
        import torch.distributed as dist

        facts["group_world_size"] = dist.get_world_size(tp.group)
        facts["group_rank"] = dist.get_rank(tp.group)
    return facts


def world_mismatch(reports: dict[int, dict[str, Any]], world_size: int) -> str | None:
    """None when every rank's report (group_facts, plus what its build says it built) fits a
    world of world_size ranks and matches rank 0's; else what is wrong, naming the rank."""
    for rank in sorted(reports):
        report = reports[rank]
        if report.get("group_world_size") != world_size:
            return (f"tensor-parallel worker rank {rank} joined a group of {report.get('group_world_size')} "
                    f"ranks, but the engine started {world_size}: a mismatched world (another "
                    f"torch.distributed group in that process?)")
        if report.get("group_rank") != rank:
            return (f"tensor-parallel worker rank {rank} holds rank {report.get('group_rank')} in its "
                    f"group: a mismatched world")
    first = reports[min(reports)]
    for rank in sorted(reports):
        report = reports[rank]
        for key in sorted(set(first) | set(report)):
            if key in PER_RANK_KEYS:
                continue
            if report.get(key) != first.get(key):
                return (f"tensor-parallel worker rank {rank} disagrees with rank {min(reports)} on "
                        f"{key}: {report.get(key)!r} vs {first.get(key)!r}; every rank must build "
                        f"the same engine")
    return None


def start_failure(rank: int, world_size: int, failed: list[int], error: BaseException | None,
                  text: str) -> BaseException | None:
    """The worker's own exception type (so `except ValueError` and the CLI's clean error line
    behave as with one device) with a message that names the rank, when that type can be built
    from one message; None when it cannot (the caller raises WorkerFailed)."""
    if error is None or len(error.args) != 1 or not isinstance(error.args[0], str):
        return None
    others = [r for r in failed if r != rank]
    also = f" (rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} too)" if others else ""
    message = f"tensor-parallel worker rank {rank} of {world_size} could not start{also}: {error.args[0]}"
    try:
        rebuilt = type(error)(message)
    except Exception:  # noqa: BLE001 -- a type with another constructor: the caller falls back
        return None
    if type(rebuilt) is not type(error) or str(rebuilt) != message:
        return None
    rebuilt.add_note(f"the worker's traceback (rank {rank}):\n{text}")
    return rebuilt


def last_line(text: str) -> str:
    """The last non-empty line of a traceback: the exception and its message."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no traceback)"
