"""What every kernel benchmark script writes beside its table: the run's provenance (GPU, torch,
Triton, commit, UTC date) and its rows, as OUT_DIR/<name>.json; and how the experiment scripts
time a captured sequence of launches (graph_replay_ms)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_result(out_dir: str, stem: str, benchmark: str, fields: dict) -> str:
    """OUT_DIR/<stem>.json with {"benchmark": benchmark, provenance..., **fields}; returns the path."""
    import torch
    import triton

    result = {
        "benchmark": benchmark,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **fields,
    }
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{stem}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
    return path


def graph_replay_ms(fn, reps: int = 20, warmup: int = 3):
    """(median ms of one replay, fn's output) for fn captured once in a CUDA graph: no launch cost,
    as in the engine's decode graphs. fn runs once eagerly first (compiles)."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return replay_ms(graph, reps, warmup), out


def replay_ms(graph, reps: int = 20, warmup: int = 3) -> float:
    """Median ms of one replay of a captured CUDA graph, timed with events one replay at a time."""
    import statistics

    import torch

    times = []
    for _ in range(reps + warmup):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[warmup:])
