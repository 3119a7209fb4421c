"""Starting a tensor-parallel group: torch.distributed over gloo on CPU and NCCL on GPUs.

start_tensor_parallel runs once in each rank's process (the engine's workers, or a test's spawned
processes) and returns the TensorParallel that rank passes down through ModelOptions. The group
is an argument, not a global: nothing here is read later by a layer.
"""

from __future__ import annotations

import socket

import torch

from foretell.distributed.tensor_parallel import TensorParallel

BACKENDS = ("auto", "gloo", "nccl")


def free_local_port() -> int:
    """A TCP port on localhost that is free now (for the rendezvous address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def backend_for(device: torch.device, backend: str = "auto") -> str:
    if backend not in BACKENDS:
        raise ValueError(f"distributed backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"the nccl backend needs CUDA devices, got device {device}")
    return backend


def start_tensor_parallel(
    rank: int,
    world_size: int,
    init_method: str,  # e.g. "tcp://127.0.0.1:29500", the same for every rank
    device: torch.device,
    backend: str = "auto",
    timeout_s: float = 60.0,
) -> TensorParallel:
    """Join the group (blocks until every rank has joined) and return this rank's TensorParallel.
    With world_size 1 no process group is made."""
    if world_size == 1:
        return TensorParallel()
    import datetime

    import torch.distributed as dist

    backend = backend_for(device, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group")
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return TensorParallel(rank, world_size, dist.group.WORLD)


def stop_tensor_parallel(tp: TensorParallel) -> None:
    if tp.is_parallel:
        import torch.distributed as dist

        dist.destroy_process_group()
