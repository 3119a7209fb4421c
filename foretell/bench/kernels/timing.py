"""How `foretell bench kernels` (and any script) times one kernel or layer call on the current
device: `time_kernel(fn, device)` returns a KernelTiming (median, min and max microseconds per
call, over `iters` timed runs after `warmup` untimed ones).

  - CUDA, eager: each run is bracketed by CUDA events on the current stream and waited for alone,
    so the time includes the call's launch cost as the device sees it. `flush_l2_bytes` zeroes a
    buffer of that size before each run (outside the events): a call then reads its inputs from
    HBM, as one layer of a real step does after the layers before it evicted them.
  - CUDA, `cuda_graph=True`: fn is captured once in a CUDA graph and each replay is timed with
    events: no launch cost, as the engine's decode graphs run kernels.
  - CPU: time.perf_counter around each run.

A run may make several calls of the kernel (`calls_per_run`, e.g. one per layer's copy of the
weights so that the copies together outsize L2); the times are per call. KernelTiming turns the
time into achieved bandwidth and throughput from the bytes and floating-point operations the caller
says one call moves and does (it counts nothing itself).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from foretell.device_util import graph_capture


@dataclass(frozen=True)
class KernelTiming:
    median_us: float  # per call
    min_us: float
    max_us: float
    iters: int  # timed runs
    calls_per_run: int
    timer: str  # "cuda_events", "cuda_graph" or "perf_counter"

    def gb_per_s(self, num_bytes: float) -> float:
        """Achieved bandwidth at the median time for a call that moves num_bytes."""
        return num_bytes / (self.median_us * 1e-6) / 1e9

    def tflops(self, flops: float) -> float:
        """Achieved TFLOP/s at the median time for a call that does `flops` operations."""
        return flops / (self.median_us * 1e-6) / 1e12

    def as_dict(self) -> dict[str, Any]:
        return {"median_us": self.median_us, "min_us": self.min_us, "max_us": self.max_us,
                "iters": self.iters, "calls_per_run": self.calls_per_run, "timer": self.timer}


def check_timing_args(device: torch.device, warmup: int, iters: int, calls_per_run: int,
                      cuda_graph: bool, flush_l2_bytes: int) -> None:
    """ValueError naming the argument a caller got wrong."""
    if iters < 1:
        raise ValueError(f"iters must be at least 1, got {iters}")
    if warmup < 0:
        raise ValueError(f"warmup must be 0 or more, got {warmup}")
    if calls_per_run < 1:
        raise ValueError(f"calls_per_run must be at least 1, got {calls_per_run}")
    if flush_l2_bytes < 0:
        raise ValueError(f"flush_l2_bytes must be 0 or more, got {flush_l2_bytes}")
    if device.type != "cuda" and (cuda_graph or flush_l2_bytes):
        what = "cuda_graph=True" if cuda_graph else "flush_l2_bytes"
        raise ValueError(f"{what} needs a CUDA device, got device {device}")


def time_kernel(
    fn: Callable[[], Any],
    device: torch.device | str,
    *,
    warmup: int = 3,
    iters: int = 20,
    calls_per_run: int = 1,
    cuda_graph: bool = False,
    flush_l2_bytes: int = 0,
) -> KernelTiming:
    """Time fn() (which makes calls_per_run calls of the kernel) on device; see the module doc."""
    device = torch.device(device)
    check_timing_args(device, warmup, iters, calls_per_run, cuda_graph, flush_l2_bytes)
    if device.type != "cuda":
        times_s = _time_host(fn, warmup, iters)
        timer = "perf_counter"
    elif cuda_graph:
        times_s = _time_graph(fn, device, warmup, iters)
        timer = "cuda_graph"
    else:
        times_s = _time_events(fn, device, warmup, iters, flush_l2_bytes)
        timer = "cuda_events"
    per_call_us = [t * 1e6 / calls_per_run for t in times_s]
    return KernelTiming(statistics.median(per_call_us), min(per_call_us), max(per_call_us), iters,
                        calls_per_run, timer)


def _time_host(fn: Callable[[], Any], warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _time_events(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int,
                 flush_l2_bytes: int) -> list[float]:
    flush = torch.empty(flush_l2_bytes, dtype=torch.uint8, device=device) if flush_l2_bytes else None
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def _time_graph(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> list[float]:
    with torch.cuda.device(device):
        fn()  # compiles (Triton) and settles allocations before capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph):
            fn()
        return _time_events(graph.replay, device, warmup, iters, 0)
