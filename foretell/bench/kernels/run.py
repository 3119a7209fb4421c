"""Running kernel cases: the kernels by name (KERNELS), run_kernel_bench (every case of the asked
kernels, each path timed and checked against the case's reference path), and the report: a
table and a JSON-ready dict with the run's provenance (device, torch, Triton, commit, date).
"""

from __future__ import annotations

import datetime
import math
import os
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from foretell.bench.kernels.cases import PRESETS, KernelCase, attention_cases, mla_cases
from foretell.bench.kernels.cases_linear import (
    gemm_fp8_cases, gemm_small_m_cases, moe_cases, moe_int4_cases, pointwise_cases,
)
from foretell.bench.kernels.timing import time_kernel

CaseBuilder = Callable[[str, str, torch.device, torch.dtype], Iterator[KernelCase]]

KERNELS: dict[str, CaseBuilder] = {
    "attention_decode": attention_cases,  # paged GQA attention, 1 query token a sequence
    "attention_verify": attention_cases,  # ... 4 query tokens (k = 3 drafts + 1)
    "attention_prefill": attention_cases,  # ... a whole prompt
    "mla_decode": mla_cases,  # latent attention (DeepSeek, Kimi), 1 query token
    "mla_verify": mla_cases,  # ... 4 query tokens
    "moe": moe_cases,  # bf16 experts' weighted sum
    "moe_int4": moe_int4_cases,  # int4 experts (Kimi-K2.5)
    "gemm_small_m": gemm_small_m_cases,  # the few-row linear of decode and verify
    "gemm_fp8": gemm_fp8_cases,  # FP8 block-quantized linear (DeepSeek-V3, Kimi)
    "rms_norm": pointwise_cases,  # residual add + RMSNorm
    "rope": pointwise_cases,  # RoPE on q and k
    "silu_and_mul": pointwise_cases,  # the MLP's activation
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class KernelBenchSettings:
    kernels: list[str]
    device: str = "auto"  # "auto": CUDA when available, else the CPU
    dtype: str = "bfloat16"
    preset: str = "auto"  # "auto": full on CUDA, tiny elsewhere
    warmup: int = 3
    iters: int = 20
    cuda_graph: bool = True  # also time the graph-safe paths as CUDA-graph replays (CUDA only)

    def __post_init__(self):
        unknown = [k for k in self.kernels if k not in KERNELS]
        if unknown or not self.kernels:
            raise ValueError(f"unknown kernels {unknown or self.kernels}; expected some of: {', '.join(KERNELS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.preset not in ("auto",) + PRESETS:
            raise ValueError(f"preset must be one of auto, {', '.join(PRESETS)}, got {self.preset!r}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but torch sees no CUDA device")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError(f"iters must be >= 1 and warmup >= 0, got iters {self.iters}, warmup {self.warmup}")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_preset(self, device: torch.device) -> str:
        if self.preset == "auto":
            return "full" if device.type == "cuda" else "tiny"
        return self.preset


def outputs(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for t in value if isinstance(t, torch.Tensor)]


def max_abs_diff(got: Any, expected: Any) -> float | None:
    """The largest elementwise difference over the outputs; None where it is not finite (a NaN
    or an inf in either: JSON has no NaN, and the table shows "-")."""
    pairs = list(zip(outputs(got), outputs(expected), strict=True))
    diffs = [(a.float() - b.float()).abs().max().item() for a, b in pairs]
    return max(diffs) if all(math.isfinite(d) for d in diffs) else None


def run_case(case: KernelCase, device: torch.device, warmup: int, iters: int, cuda_graph: bool) -> dict[str, Any]:
    """One row: the case's shape and, per path, its time per call (eager, and as a graph replay
    where it may be captured), bandwidth, throughput and largest difference from the reference.
    A path that fails (a kernel this Triton cannot build) records its error; the others still run."""
    row: dict[str, Any] = {"kernel": case.kernel, "shape": case.shape, "reference": case.reference,
                           "bytes_per_call": case.bytes_per_call, "flops_per_call": case.flops_per_call,
                           "calls_per_run": case.calls_per_run, **case.notes, "paths": {}}
    with torch.inference_mode():
        expected = case.paths[case.reference].run()
        for name, path in case.paths.items():
            entry: dict[str, Any] = {}
            try:
                entry["max_abs_err"] = 0.0 if name == case.reference else max_abs_diff(path.run(), expected)
                eager = time_kernel(path.run, device, warmup=warmup, iters=iters, calls_per_run=case.calls_per_run)
                entry.update(us=eager.median_us, gb_per_s=eager.gb_per_s(case.bytes_per_call),
                             tflops=eager.tflops(case.flops_per_call), eager=eager.as_dict())
                if cuda_graph and path.graph_safe and device.type == "cuda":
                    graph = time_kernel(path.run, device, warmup=warmup, iters=iters,
                                        calls_per_run=case.calls_per_run, cuda_graph=True)
                    entry.update(graph_us=graph.median_us, graph_gb_per_s=graph.gb_per_s(case.bytes_per_call),
                                 graph=graph.as_dict())
            except Exception as error:  # record and go on: one path must not hide the rest
                entry["error"] = f"{type(error).__name__}: {error}"
            row["paths"][name] = entry
    return row


def run_kernel_bench(settings: KernelBenchSettings, on_row: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Every case of settings.kernels; on_row sees each row as it is measured."""
    device = settings.resolved_device()
    preset = settings.resolved_preset(device)
    dtype = DTYPES[settings.dtype]
    rows = []
    for kernel in settings.kernels:
        for case in KERNELS[kernel](kernel, preset, device, dtype):
            row = run_case(case, device, settings.warmup, settings.iters, settings.cuda_graph)
            rows.append(row)
            if on_row is not None:
                on_row(row)
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the case's weight and cache copies
    return {"benchmark": "kernels", **provenance(device), "dtype": settings.dtype, "preset": preset,
            "warmup": settings.warmup, "iters": settings.iters,
            "timing": "median microseconds per call (foretell.bench.kernels.timing.time_kernel)", "rows": rows}


def provenance(device: torch.device) -> dict[str, Any]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "triton": triton_version, "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def git_commit() -> str:
    """The short commit of the checkout foretell runs from, or "unknown" (an installed wheel)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


SHAPE_KEYS = ("model", "linear", "batch", "context", "query_len", "num_tokens", "m", "n", "k")


def shape_text(shape: dict[str, Any]) -> str:
    """The varying part of a case's shape, e.g. "batch 16 context 4096 query_len 4"."""
    return " ".join(f"{key} {shape[key]}" if key not in ("model", "linear") else str(shape[key])
                    for key in SHAPE_KEYS if key in shape)


def format_rows(rows: list[dict[str, Any]]) -> str:
    from foretell.bench.report import fmt, table

    headers = ("kernel", "shape", "path", "us", "graph us", "GB/s", "TFLOP/s", "max err")
    lines = []
    for row in rows:
        for name, p in row["paths"].items():
            if "error" in p:
                lines.append([row["kernel"], shape_text(row["shape"]), name, "failed: " + p["error"][:60],
                              "", "", "", ""])
                continue
            best_us = p.get("graph_us", p["us"])
            lines.append([row["kernel"], shape_text(row["shape"]), name, fmt(p["us"], ".1f"),
                          fmt(p.get("graph_us"), ".1f"), fmt(row["bytes_per_call"] / (best_us * 1e-6) / 1e9, ".0f"),
                          fmt(row["flops_per_call"] / (best_us * 1e-6) / 1e12, ".2f"), fmt(p["max_abs_err"], ".1e")])
    return table(headers, lines)
