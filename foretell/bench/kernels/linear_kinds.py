"""The three families of one-row linears a decode step can run, as the in-graph linear sweep
(linear_chain.py, scripts/sweep_linears_in_graph_gpu.py) builds, launches and checks them:

  "fp8"              ops/gemm/triton_fp8_few_rows.py with 128x128 block scales (what
                     quantization="fp8" makes of Llama's qkv, o, gate_up and down); the LM head stays
                     a bf16 linear in that mode (LMHead is not a quantized Linear), so it runs the
                     bf16 GEMV here too;
  "bf16"             the engine's few-row kernels in the model dtype (ops/gemm/triton_kernels.py:
                     the GEMV of triton_gemv.py at one row, the MMA at 2..16, cuBLAS above);
  "batch_invariant"  ops/gemm/triton_batch_invariant.py, ModelConfig.batch_invariant's linear.

Each family knows, per layer kind (qkv, o, gate_up, down, lm_head): the engine's default config,
the candidate configs, how to launch one through the kernel module's public function (gate_up
gated: silu(gate) * up in the epilogue; lm_head float32_out, as the layers call them) and the
torch twin a candidate is checked against. On the CPU (`use_kernels=False`) every launch is the
twin: the sweep's smoke test runs without triton kernels or graphs.

Batch-invariant knobs. The mode's bits are fixed by (BLOCK_K, SPLIT), which pick_shape_config
chooses from (N, K) alone. Candidates that keep the mode's reduction order vary only launch
choices: num_stages (pipeline depth) and, above 16 rows, the row tile fixed_block_m (the module
says a row's sums do not depend on it; tests/gpu/test_batch_invariant_gpu.py checks that on the
device). num_warps is not a knob: the kernel fixes it (NUM_WARPS) and a wider program could reduce
a K step by other tensor-core instructions. `reorder=True` adds shape configs with other bits than
today's, each still batch-invariant if the mode adopted it per (N, K) for every M: first the rows of W
a program owns, BLOCK_N 32, 16 and 128 (pick_shape_config has 64 for every shape), at the mode's
(BLOCK_K, SPLIT) and then at the (BLOCK_K, SPLIT) the mode's rule gives that many tiles; then other
(BLOCK_K, SPLIT) pairs at those BLOCK_N, and last at 64. BLOCK_N is among the reordering candidates
because at 16 and 32 rows Triton reduces each K chunk by mma.sync instead of wgmma, which need not
round alike (the interpreter cannot tell: its dot is no tensor core), so the sweep checks them
against the twin within rounding, not bitwise against the default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

LAYER_KINDS = ("qkv", "o", "gate_up", "down", "lm_head")
FP8_BLOCK = (128, 128)
# Rows of W per batch-invariant program tried with reorder (the mode's own 64 besides), most likely first.
INVARIANT_BLOCK_N = (32, 16, 128)
# bf16 GEMV tiles tried at one row: rows of W per program x columns per tile x warps, kept when a
# thread holds 16..128 weights a tile (fewer starve the loads, more spill registers).
BF16_GEMV_ROWS = (1, 2, 4, 8)
BF16_GEMV_COLUMNS = (1024, 2048, 4096)
BF16_GEMV_WARPS = (2, 4, 8)


@dataclass(frozen=True)
class InvariantLaunch:
    """A batch-invariant launch: the shape config (None: pick_shape_config's, what the mode runs)
    and the launch choices that keep its sums (None: the module's own)."""

    shape: Any = None  # triton_batch_invariant.ShapeConfig | None
    num_stages: int | None = None
    fixed_block_m: int | None = None

    def __str__(self) -> str:
        parts = [str(self.shape) if self.shape is not None else "invariant (mode's BK, split)"]
        if self.num_stages is not None:
            parts.append(f"s{self.num_stages}")
        if self.fixed_block_m is not None:
            parts.append(f"BM{self.fixed_block_m}")
        return " ".join(parts)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def close_error(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> str | None:
    """None if got is within tolerance of want (relative to want's largest value), else why not."""
    if got.shape != want.shape:
        return f"shape {list(got.shape)} != {list(want.shape)}"
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item() + 1e-12
    return None if err <= tolerance * scale else f"max error {err:.3g} > {tolerance} x {scale:.3g}"


def random_bf16_weight(n: int, k: int, dtype: torch.dtype, device: torch.device,
                       gen: torch.Generator) -> torch.Tensor:  # [n, k], entries ~ N(0, 1 / k)
    return (torch.randn(n, k, device=device, generator=gen, dtype=dtype) * k**-0.5).to(dtype)


class Bf16Linears:
    """The engine's few-row kernels in the model dtype (ops/gemm/triton_kernels.py)."""

    name = "bf16"
    tolerance = 2e-2

    def __init__(self, dtype: torch.dtype, device: torch.device, use_kernels: bool):
        self.dtype, self.device, self.use_kernels = dtype, device, use_kernels

    def make_weight(self, kind: str, n: int, k: int, gen: torch.Generator):
        return random_bf16_weight(n, k, self.dtype, self.device, gen)

    def weight_bytes(self, kind: str, n: int, k: int) -> int:
        return n * k * torch.tensor([], dtype=self.dtype).element_size()

    def default(self, kind: str, m: int, n: int, k: int):
        """Mode "on"'s choice (None: cuBLAS)."""
        from foretell.ops.gemm import triton_kernels

        return triton_kernels.default_config(m, n, k, self.dtype, self.device)

    def candidates(self, kind: str, m: int, n: int, k: int) -> list:
        """The default, the module's candidate_configs, then at one row a grid of GEMV tiles."""
        from foretell.ops.gemm import triton_gemv, triton_kernels

        configs = [self.default(kind, m, n, k)]
        configs += triton_kernels.candidate_configs(m, n, k, self.dtype, self.device)
        if m == 1:
            for rows in BF16_GEMV_ROWS:
                for columns in BF16_GEMV_COLUMNS:
                    columns = min(columns, _next_pow2(k))
                    for warps in BF16_GEMV_WARPS:
                        if 16 <= rows * columns // (32 * warps) <= 128:
                            configs.append(triton_gemv.SmallMConfig(1, rows, columns, warps))
        if kind == "gate_up":  # (gate j, up j) pairs per program
            configs = [c for c in configs if c is None or getattr(c, "block_n", 2) % 2 == 0]
        return list(dict.fromkeys(configs))

    def launch(self, kind: str, x: torch.Tensor, weight, config) -> torch.Tensor:
        if not self.use_kernels or config is None:
            return self.twin(kind, x, weight)
        from foretell.ops.gemm import triton_kernels

        return triton_kernels.small_m_linear(x, weight, None, config, gated=kind == "gate_up",
                                             float32_out=kind == "lm_head")

    def twin(self, kind: str, x: torch.Tensor, weight) -> torch.Tensor:
        """F.linear (cuBLAS on CUDA), then the layer's activation or float32 logits."""
        from foretell.ops.pointwise.dispatch import silu_and_mul

        y = F.linear(x, weight)
        if kind == "gate_up":
            return silu_and_mul(y)
        return y.float() if kind == "lm_head" else y


class Fp8Linears:
    """ops/gemm/triton_fp8_few_rows.py with 128x128 blocks; the LM head stays bf16 (as the engine)."""

    name = "fp8"
    tolerance = 2e-2

    def __init__(self, dtype: torch.dtype, device: torch.device, use_kernels: bool):
        self.dtype, self.device, self.use_kernels = dtype, device, use_kernels
        self.head = Bf16Linears(dtype, device, use_kernels)

    def make_weight(self, kind: str, n: int, k: int, gen: torch.Generator):
        """(q [n, k] float8_e4m3fn, scale [n / 128, k / 128] float32) with products near N(0, 1 / k)."""
        if kind == "lm_head":
            return self.head.make_weight(kind, n, k, gen)
        q = torch.randn(n, k, device=self.device, generator=gen, dtype=self.dtype).to(torch.float8_e4m3fn)
        blocks = (math.ceil(n / FP8_BLOCK[0]), math.ceil(k / FP8_BLOCK[1]))
        scale = (torch.rand(blocks, device=self.device, generator=gen) + 0.5) * k**-0.5  # [n / 128, k / 128]
        return q, scale

    def weight_bytes(self, kind: str, n: int, k: int) -> int:
        if kind == "lm_head":
            return self.head.weight_bytes(kind, n, k)
        return n * k + math.ceil(n / FP8_BLOCK[0]) * math.ceil(k / FP8_BLOCK[1]) * 4

    def default(self, kind: str, m: int, n: int, k: int):
        if kind == "lm_head":
            return self.head.default(kind, m, n, k)
        from foretell.ops.gemm import triton_fp8_few_rows as few

        return few.default_config(m, n, k, self.dtype, FP8_BLOCK, self.device)

    def candidates(self, kind: str, m: int, n: int, k: int) -> list:
        """The default, the module's candidate_configs (GEMV tiles, warps, splits; the MMA with 15
        padding rows), then the default's GEMV at 2 and 8 warps and split 2 and 4; GEMV configs whose
        rows would straddle a scale block (gate and up rows each, for gate_up) are left out.
        The kernel has no whole-tile (EVEN_K) variant to try: it was dropped (docs/perf-log.md)."""
        if kind == "lm_head":  # a bf16 GEMV in this mode too: the bf16 family sweeps its tiles
            return [self.head.default(kind, m, n, k)]
        from foretell.ops.gemm import triton_fp8_few_rows as few
        from foretell.ops.gemm import triton_fp8_gemv as gemv

        gated = kind == "gate_up"
        default = self.default(kind, m, n, k)
        configs = [default] + few.candidate_configs(m, n, k, self.dtype, FP8_BLOCK, self.device)
        if isinstance(default, gemv.Fp8GemvConfig):
            for warps in (2, 8):
                configs.append(gemv.gemv_config(m, n, k, default.block_k, default.block_n, warps, default.split))
            for split in (2, 4):
                if k // split >= default.block_k:
                    configs.append(gemv.gemv_config(m, n, k, default.block_k, default.block_n, default.num_warps,
                                                    split))
        kept = []
        for config in dict.fromkeys(configs):
            if isinstance(config, gemv.Fp8GemvConfig):
                if not few.gemv_rows_fit_blocks(config.block_n, n, FP8_BLOCK, gated) or (gated and config.block_n % 2):
                    continue
            kept.append(config)
        return kept

    def launch(self, kind: str, x: torch.Tensor, weight, config) -> torch.Tensor:
        if kind == "lm_head":
            return self.head.launch(kind, x, weight, config)
        if not self.use_kernels:
            return self.twin(kind, x, weight)
        from foretell.ops.gemm import triton_fp8_few_rows as few

        q, scale = weight
        return few.fp8_few_rows_linear(x, q, scale, FP8_BLOCK, None, config, gated=kind == "gate_up")

    def twin(self, kind: str, x: torch.Tensor, weight) -> torch.Tensor:
        if kind == "lm_head":
            return self.head.twin(kind, x, weight)
        from foretell.ops.gemm.fp8_reference import fp8_linear_torch
        from foretell.ops.pointwise.reference import silu_and_mul_torch

        y = fp8_linear_torch(x, weight[0], weight[1], FP8_BLOCK)  # [M, N]
        return silu_and_mul_torch(y) if kind == "gate_up" else y


class BatchInvariantLinears:
    """ops/gemm/triton_batch_invariant.py at the mode's shape configs (module docstring: knobs)."""

    name = "batch_invariant"
    tolerance = 2e-2

    def __init__(self, dtype: torch.dtype, device: torch.device, use_kernels: bool, reorder: bool = False):
        from foretell.ops.common.split_counters import SplitCounters

        self.dtype, self.device, self.use_kernels, self.reorder = dtype, device, use_kernels, reorder
        self.counters = SplitCounters(min_count=1 << 16)  # as BatchInvariantGemm holds them
        self.bf16 = Bf16Linears(dtype, device, use_kernels)

    def make_weight(self, kind: str, n: int, k: int, gen: torch.Generator):
        return self.bf16.make_weight(kind, n, k, gen)

    def weight_bytes(self, kind: str, n: int, k: int) -> int:
        return self.bf16.weight_bytes(kind, n, k)

    def default(self, kind: str, m: int, n: int, k: int) -> InvariantLaunch:
        return InvariantLaunch()

    def candidates(self, kind: str, m: int, n: int, k: int) -> list[InvariantLaunch]:
        """The mode's launch first; then, at the mode's (BLOCK_K, SPLIT): every other pipeline depth
        1..4 and, above 16 rows, every other row tile; with reorder, the shape configs of
        _reordering_shapes (other BLOCK_N first, then other (BLOCK_K, SPLIT) pairs)."""
        from foretell.ops.gemm import triton_batch_invariant as bi

        shape = bi.pick_shape_config(n, k, self.dtype, self.device)
        _, smem = bi.device_limits(self.device)
        itemsize = torch.tensor([], dtype=self.dtype).element_size()
        stages = bi._stages_that_fit(shape.block_n, bi.row_tile(m, shape.block_k), shape.block_k, itemsize, smem)
        configs = [InvariantLaunch()]
        configs += [InvariantLaunch(num_stages=s) for s in (1, 2, 3, 4) if s != stages]
        if m > 16:
            own_tile = bi.row_tile(m, shape.block_k)
            configs += [InvariantLaunch(fixed_block_m=b) for b in (16, 32, 64, 128) if b != own_tile]
        if self.reorder:
            configs += [InvariantLaunch(shape=other) for other in self._reordering_shapes(n, k, shape)]
        return list(dict.fromkeys(configs))

    def _reordering_shapes(self, n: int, k: int, shape) -> list:
        """Shape configs other than the mode's `shape` for W [n, k], in the order the sweep should
        reach them within its budget: each BLOCK_N of INVARIANT_BLOCK_N at the mode's (BLOCK_K,
        SPLIT), then each at the (BLOCK_K, SPLIT) that the mode's rule gives its tile count, then
        every (BLOCK_K, SPLIT) pair (no slice of K shorter than one step) at the other BLOCK_N,
        and last at the mode's BLOCK_N (those pairs were swept before: none beat the mode's)."""
        from foretell.ops.gemm import triton_batch_invariant as bi

        shapes = [bi.ShapeConfig(shape.block_k, shape.split, block_n) for block_n in INVARIANT_BLOCK_N]
        shapes += [bi.shape_config_for_tile(n, k, self.dtype, self.device, block_n) for block_n in INVARIANT_BLOCK_N]
        for block_ns in (INVARIANT_BLOCK_N, (shape.block_n,)):  # the mode's BLOCK_N last: swept before
            for block_k in (256, 128, 64):  # wide steps first: the mode's unsplit choice at few tiles
                for split in (1, 2, 4, 8):
                    for block_n in block_ns:
                        other = bi.ShapeConfig(min(block_k, max(16, _next_pow2(k))), split, block_n)
                        if k // split >= other.block_k:
                            shapes.append(other)
        return [other for other in dict.fromkeys(shapes) if other != shape]

    def keeps_default_bits(self, config: InvariantLaunch) -> bool:
        """Whether the launch must give the mode's bits (then the sweep checks it does, bitwise)."""
        return config.shape is None and self.use_kernels

    def launch(self, kind: str, x: torch.Tensor, weight, config: InvariantLaunch) -> torch.Tensor:
        if not self.use_kernels:
            return self.twin(kind, x, weight)
        from foretell.ops.gemm import triton_batch_invariant as bi

        return bi.linear_batch_invariant_triton(
            x, weight, None, gated=kind == "gate_up", float32_out=kind == "lm_head", counters=self.counters,
            fixed_block_m=config.fixed_block_m, config=config.shape, num_stages=config.num_stages)

    def twin(self, kind: str, x: torch.Tensor, weight) -> torch.Tensor:
        from foretell.ops.gemm.batch_invariant import linear_batch_invariant_torch

        return linear_batch_invariant_torch(x, weight, gated=kind == "gate_up", float32_out=kind == "lm_head")


LINEAR_FAMILIES = {"fp8": Fp8Linears, "bf16": Bf16Linears, "batch_invariant": BatchInvariantLinears}
