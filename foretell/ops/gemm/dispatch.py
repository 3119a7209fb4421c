"""When a linear layer's few-row matmul runs a Triton kernel (ops/gemm/triton_kernels.py: the GEMV for
one row, the tensor-core MMA for 2 to 16) instead of cuBLAS (F.linear): always ("on", the default on
CUDA), or decided by timing them once per shape.

A SmallMGemm is bound to the model's Linear and LMHead layers by prepare_small_m_linears
(layers/small_m.py; the runner does it on CUDA before capturing its graphs); each layer then calls it instead of F.linear.
It owns a decision per GemmKey (rows rounded up to a power of two, N, K, dtype, bias or not):
  - mode "off": no SmallMGemm is bound at all, every layer calls F.linear;
  - mode "on" (the default): triton_kernels.default_config, untimed, for up to 16 rows: the GEMV
    for one row (decode at batch 1), the MMA for 2 to 16 (verify, a 16-node tree's verify, small
    batches; fp16 / bf16) at any K. (Until 2026-11-30 a K above 4096, the down projection's 14336,
    went to cuBLAS from two rows on: the MMA lost inside the verify graph while the down projection
    applied the activation; with the activation in gate_up's epilogue its split-K won there,
    docs/perf-log.md, twelfth GPU session.) Chosen by timing whole decode graphs on the H200:
    only the kernels overlap the kernel before them, which timing one call alone cannot see;
  - mode "auto": for up to MAX_M rows, at the first call of a key (or when warmed up front)
    F.linear and each of the kernels' candidate configs run on random rows against the layer's own
    weight, timed on the device (L2 flushed before each rep, as a decode step reads its weights
    from HBM); the kernel wins only if it compiles, gives the same result and beats cuBLAS by
    MIN_SPEEDUP. During CUDA-graph capture nothing is timed: a decided key keeps its choice, an
    undecided one gets cuBLAS.
So the kernel can make a layer no slower than cuBLAS was when timed. Everything it does not
apply to (many rows, CPU tensors, autograd, odd dtypes or strides) goes to F.linear unasked.

Importing this module never imports triton: the kernel module is loaded on the first decision
that needs it, which only CUDA tensors reach.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from foretell.config import SMALL_M_GEMM_MODES
from foretell.ops.common import kernel_choice
from foretell.ops.pointwise.dispatch import silu_and_mul

logger = logging.getLogger("foretell")

MODES = SMALL_M_GEMM_MODES  # auto | on | off
# Both modes use the kernels up to this many rows (triton_kernels.MAX_M, restated so that this module
# needs no triton): on the H200 the GEMV made the Llama-8B decode graph faster than cuBLAS at M = 1,
# the MMA its 4-token verify graph (docs/perf-log.md).
MAX_M = 16
MIN_SPEEDUP = 1.03  # the kernel must beat cuBLAS by this factor: noise never flips a layer
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def m_bucket(m: int) -> int:
    return 1 << max(m - 1, 0).bit_length()


@dataclass(frozen=True)
class GemmKey:
    m_bucket: int
    n: int
    k: int
    dtype: torch.dtype
    has_bias: bool


class CudaEventTimer:
    """Median device time of fn over `reps` runs, each after a write of flush_bytes (which
    evicts L2, and keeps the device busy while the host enqueues fn, so launch cost is not
    counted: in a CUDA graph there is none)."""

    def __init__(self, reps: int = 10, warmup: int = 2, flush_bytes: int = 256 << 20):
        self.reps, self.warmup, self.flush_bytes = reps, warmup, flush_bytes

    def __call__(self, fn: Callable[[], Any], device: torch.device) -> float:
        for _ in range(self.warmup):
            fn()
        flush = torch.empty(self.flush_bytes // 4, dtype=torch.int32, device=device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.reps)]
        for start, end in events:
            flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = sorted(start.elapsed_time(end) for start, end in events)
        return times[len(times) // 2] * 1e-3


def _agree(got: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Same result up to rounding: a sanity check against a broken kernel, not a precision test.
    Allowed per element: one rounding of the dtype either way, plus float32 sums in another order
    (about sqrt(K) roundings of |x_m| |w_n|, with a wide margin)."""
    x_norms = x.float().norm(dim=1)  # [M]
    w_norms = torch.cat([rows.float().norm(dim=1) for rows in weight.split(4096)])  # [N], in chunks
    tolerance = 2 * torch.finfo(expected.dtype).eps * expected.float().abs() + (
        2.0**-20 * x.shape[1] ** 0.5 * x_norms[:, None] * w_norms[None, :]
    )
    return bool(((got.float() - expected.float()).abs() <= tolerance).all())


def _linear_torch(x, weight, bias, gated: bool, float32_out: bool) -> torch.Tensor:
    """What SmallMGemm computes, in torch: the reference and the path of everything it leaves."""
    y = F.linear(x, weight, bias)
    y = silu_and_mul(y) if gated else y
    return y.float() if float32_out else y


class SmallMGemm:
    """Callable like F.linear(x, weight, bias); picks cuBLAS or the kernel per GemmKey.

    kernels: the module with small_m_linear and candidate_configs (default ops/gemm/triton_kernels.py,
    imported on first need); timer(fn, device) -> seconds; is_capturing() -> bool. Tests pass
    fakes for all three."""

    def __init__(
        self,
        mode: str = "auto",
        max_m: int = MAX_M,
        *,
        kernels: Any = None,
        timer: Callable[[Callable[[], Any], torch.device], float] | None = None,
        is_capturing: Callable[[], bool] | None = None,
    ):
        if mode not in ("auto", "on"):
            raise ValueError(f"SmallMGemm mode must be auto or on, got {mode!r} (off: bind none)")
        self.mode = mode
        self.max_m = m_bucket(max(1, min(max_m, MAX_M)))  # a whole bucket: no key half-served
        self._kernels = kernels
        self.timer = timer or CudaEventTimer()
        self.is_capturing = is_capturing or torch.cuda.is_current_stream_capturing
        self.choices: dict[GemmKey, Any] = {}  # key -> kernel config, or None for cuBLAS
        self.timings: dict[GemmKey, dict[str, float]] = {}  # key -> candidate -> seconds

    @property
    def kernels(self):
        if self._kernels is None:
            from foretell.ops.gemm import triton_kernels  # imports triton: CUDA only

            self._kernels = triton_kernels
        return self._kernels

    def applies(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> bool:
        k = weight.shape[-1]
        if x.dim() == 0 or x.shape[-1] != k or k == 0 or not 1 <= x.numel() // k <= self.max_m:
            return False
        if x.dtype not in KERNEL_DTYPES or weight.dtype != x.dtype or not weight.is_contiguous():
            return False
        if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
            return False
        tensors = (x, weight) if bias is None else (x, weight, bias)
        return kernel_choice.use_triton(*tensors)

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        gated: bool = False,
        float32_out: bool = False,
    ) -> torch.Tensor:  # [..., K] -> [..., N] (gated: [..., N // 2])
        """F.linear(x, weight, bias); gated (weight [gate; up]): silu_and_mul of the product, in
        the kernel's epilogue; float32_out: the result (rounded to x's dtype) as float32, stored so
        by the kernel (no cast launch)."""
        if not self.applies(x, weight, bias):
            return _linear_torch(x, weight, bias, gated, float32_out)
        n, k = weight.shape
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        key = GemmKey(m_bucket(rows.shape[0]), n, k, x.dtype, bias is not None)
        config = self.choose(key, weight, bias)
        if config is None:
            return _linear_torch(x, weight, bias, gated, float32_out)
        out = self.kernels.small_m_linear(rows, weight, bias, config, gated=gated, float32_out=float32_out)  # [M, N]
        return out.view(*x.shape[:-1], out.shape[-1])

    def choose(self, key: GemmKey, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
        """The kernel config for key, or None for cuBLAS; times the key once if undecided."""
        if key in self.choices:
            return self.choices[key]
        if self.mode == "on":
            self.choices[key] = self.kernels.default_config(key.m_bucket, key.n, key.k, key.dtype, weight.device)
        elif self.is_capturing():
            return None  # cannot time inside a capture; left undecided for a later eager call
        else:
            self.choices[key] = self._measure(key, weight, bias)
        return self.choices[key]

    def _measure(self, key: GemmKey, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
        device = weight.device
        gen = torch.Generator(device).manual_seed(0)  # leaves the global generators alone
        x = torch.randn(key.m_bucket, key.k, generator=gen, device=device).to(key.dtype)  # [m_bucket, K]
        expected = F.linear(x, weight, bias)
        times = {"cublas": self.timer(lambda: F.linear(x, weight, bias), device)}
        best, best_time = None, times["cublas"] / MIN_SPEEDUP
        for config in self.kernels.candidate_configs(key.m_bucket, key.n, key.k, key.dtype, device):
            run = lambda config=config: self.kernels.small_m_linear(x, weight, bias, config)  # noqa: E731
            try:  # a config that fails to compile (or to launch) just loses to cuBLAS
                if not _agree(run(), expected, x, weight):
                    logger.warning("small-M GEMM %s disagrees with F.linear at %s; not used", config, key)
                    continue
                times[str(config)] = self.timer(run, device)
            except Exception as e:  # noqa: BLE001 (triton's compile errors have no common base)
                logger.warning("small-M GEMM %s failed at %s, not used: %s", config, key, e)
                continue
            if times[str(config)] < best_time:
                best, best_time = config, times[str(config)]
        self.timings[key] = times
        return best

    def summary(self) -> str:
        """One line per decided key: which won, and the times (for the log)."""
        lines = []
        for key, config in self.choices.items():
            times = self.timings.get(key, {})
            us = ", ".join(f"{name} {t * 1e6:.1f} us" for name, t in times.items())
            winner = "cublas" if config is None else str(config)
            lines.append(f"M<={key.m_bucket} N={key.n} K={key.k} {key.dtype}: {winner} ({us})")
        return "\n".join(lines)
