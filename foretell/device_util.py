"""Devices: checking that an asked-for device exists, moving small host lists to it without
stalling it, and capturing CUDA graphs with the garbage collector held off.

torch.tensor(values, device="cuda") copies from pageable memory, which waits for every kernel
already queued; building the tensor on the host, pinning it and copying asynchronously does not.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values: a list, or a host tensor (then converted to dtype)."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def checked_device(name: str) -> torch.device:
    """torch.device(name), with a clear error when it names a device this machine lacks."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {name} was asked for, but this machine has no CUDA GPU "
                f"(torch.cuda.is_available() is False): use --device cpu or auto"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"--device {name} was asked for, but this machine has {count} CUDA GPU(s) "
                f"(cuda:0 to cuda:{count - 1})"
            )
    return device


# dtype names a config may give -> torch dtypes (config.py keeps only the names, not torch)
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    """auto: the first CUDA GPU when there is one, else the CPU; otherwise the named device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return checked_device(name)


def resolve_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """auto: the checkpoint's torch_dtype, except half precision on CPU becomes float32."""
    if name != "auto":
        return TORCH_DTYPES[name]
    default = torch.float32 if device.type == "cpu" else torch.bfloat16
    dtype = TORCH_DTYPES.get(checkpoint_dtype or "", default)
    if device.type == "cpu" and dtype != torch.float32:
        return torch.float32
    return dtype


def release_cached_device_memory() -> None:
    """Give the CUDA caching allocator's free blocks back to the device (after an engine goes)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def graph_capture(graph: "torch.cuda.CUDAGraph", pool=None) -> Iterator[None]:
    """torch.cuda.graph(graph, pool=pool) with Python's garbage collector off for the capture.
    torch.cuda.graph collects once before the capture begins, but an allocation during it can
    start a collection that frees an older engine's CUDA graphs (one in a reference cycle), and a
    graph destroyed while a stream captures invalidates the capture ("operation not permitted
    when stream is capturing"): seen on the H200 when a second engine was built in the process
    of a first, its graphs lost and the process's CUDA generator left unusable."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if enabled:
            gc.enable()
