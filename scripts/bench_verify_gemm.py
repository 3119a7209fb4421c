"""Experiment for the verify step's linears: can a tensor-core kernel with programmatic dependent
launch beat cuBLAS on a few rows (a verify of k + 1 = 4 tokens at batch 1)?

The batch-1 GEMV (ops/gemm/triton_gemv.py) wins at one row but loses from two rows on, so a verify
step still runs cuBLAS (4.74 ms for Llama-8B against 4.35 for a decode step on the H200). This
script sweeps two tl.dot kernels over tile shapes, each program loading its first weight tile before
waiting for the kernel before it:
  - "dot": x padded to 16 rows as the MMA's A operand, BLOCK_N rows of W per program,
    BLOCK_K-wide pipelined tiles, optional split-K (float32 partial sums added by atomics into a
    zeroed float32 buffer, then cast: not deterministic, fine for an experiment);
  - "swapped": W as the A operand (64 or 128 rows of W per program, a wgmma tile on Hopper) times
    x^T padded to 16 columns, split-K by float32 partials that the last-arriving split sums in a
    fixed order (deterministic; a counter per tile, left zeroed);
  - "tma": "swapped" with W's tiles loaded through a tensor descriptor (TMA on Hopper). Each config runs as 8 back-to-back
products over distinct weights in one CUDA graph (weights streamed from HBM), us per product,
against cuBLAS the same way, and is checked against a float32 product.

    python scripts/bench_verify_gemm.py OUT_DIR [--rows 4] [--quick] [--shapes qkv o ...]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_result import graph_replay_ms, write_result  # noqa: E402
from foretell.ops.common.pdl import launch_options, let_next_kernel_launch, pdl_enabled, wait_for_previous_kernel  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


@triton.jit
def _dot_kernel(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split,
                PDL: tl.constexpr, SPLIT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of W
    k_start = tl.program_id(1) * k_per_split
    lanes = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    w_tile = w_ptr + cols[None, :].to(tl.int64) * K + (k_start + lanes)[:, None]  # [BLOCK_K, BLOCK_N]
    x_tile = x_ptr + rows[:, None] * K + (k_start + lanes)[None, :]  # [BLOCK_M, BLOCK_K]
    w = tl.load(w_tile, eviction_policy="evict_first")  # before the wait: weights never depend on it
    wait_for_previous_kernel(PDL)
    x = tl.load(x_tile, mask=(rows < M)[:, None], other=0.0)
    acc = tl.dot(x, w)  # [BLOCK_M, BLOCK_N] float32
    for k0 in range(BLOCK_K, k_per_split, BLOCK_K):
        w = tl.load(w_tile + k0, eviction_policy="evict_first")
        x = tl.load(x_tile + k0, mask=(rows < M)[:, None], other=0.0)
        acc = tl.dot(x, w, acc)
    let_next_kernel_launch(PDL)
    out = out_ptr + rows[:, None] * N + cols[None, :]
    if SPLIT:
        tl.atomic_add(out, acc, mask=(rows < M)[:, None], sem="relaxed")
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None])


@triton.jit
def _swapped_kernel(x_ptr, w_ptr, out_ptr, partial_ptr, count_ptr, M, N, K, k_per_split,
                    PDL: tl.constexpr, SPLIT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W as the MMA's A operand (BLOCK_N >= 64 rows of W: a wgmma tile) times x^T padded to
    BLOCK_M columns. Split-K without atomics on the output: each split stores a float32 partial;
    the split that arrives last at the tile's counter sums them in split order (deterministic),
    stores the output and zeroes the counter for the next call."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of W
    k_start = pid_s * k_per_split
    lanes = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)  # rows of x
    row_ok = rows < M
    w_tile = w_ptr + cols[:, None].to(tl.int64) * K + (k_start + lanes)[None, :]  # [BLOCK_N, BLOCK_K]
    x_tile = x_ptr + rows[None, :] * K + (k_start + lanes)[:, None]  # [BLOCK_K, BLOCK_M]
    w = tl.load(w_tile, eviction_policy="evict_first")
    wait_for_previous_kernel(PDL)
    x = tl.load(x_tile, mask=row_ok[None, :], other=0.0)
    acc = tl.dot(w, x)  # [BLOCK_N, BLOCK_M] float32
    for k0 in range(BLOCK_K, k_per_split, BLOCK_K):
        w = tl.load(w_tile + k0, eviction_policy="evict_first")
        x = tl.load(x_tile + k0, mask=row_ok[None, :], other=0.0)
        acc = tl.dot(w, x, acc)
    let_next_kernel_launch(PDL)
    out = out_ptr + rows[None, :] * N + cols[:, None]  # [BLOCK_N, BLOCK_M]
    if SPLIT == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[None, :])
    else:
        parts = partial_ptr + rows[None, :] * N + cols[:, None]  # split s at + s * M * N
        tl.store(parts + pid_s * M * N, acc, mask=row_ok[None, :])
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")  # publishes the partial
        if arrived == SPLIT - 1:  # every other split's partial is visible now
            total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s in range(SPLIT):
                total += tl.load(parts + s * M * N, mask=row_ok[None, :], other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=row_ok[None, :])
            tl.atomic_xchg(count_ptr + pid_n, 0)


@triton.jit
def _swapped_tma_kernel(x_ptr, w_desc, out_ptr, partial_ptr, count_ptr, M, N, K, k_per_split,
                        PDL: tl.constexpr, SPLIT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """_swapped_kernel with W's tiles loaded through a tensor descriptor (TMA on Hopper)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    row0 = pid_n * BLOCK_N
    cols = row0 + tl.arange(0, BLOCK_N)
    k_start = pid_s * k_per_split
    lanes = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x_tile = x_ptr + rows[None, :] * K + (k_start + lanes)[:, None]  # [BLOCK_K, BLOCK_M]
    w = w_desc.load([row0, k_start])
    wait_for_previous_kernel(PDL)
    x = tl.load(x_tile, mask=row_ok[None, :], other=0.0)
    acc = tl.dot(w, x)
    for k0 in range(BLOCK_K, k_per_split, BLOCK_K):
        w = w_desc.load([row0, k_start + k0])
        x = tl.load(x_tile + k0, mask=row_ok[None, :], other=0.0)
        acc = tl.dot(w, x, acc)
    let_next_kernel_launch(PDL)
    out = out_ptr + rows[None, :] * N + cols[:, None]
    if SPLIT == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[None, :])
    else:
        parts = partial_ptr + rows[None, :] * N + cols[:, None]
        tl.store(parts + pid_s * M * N, acc, mask=row_ok[None, :])
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s in range(SPLIT):
                total += tl.load(parts + s * M * N, mask=row_ok[None, :], other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=row_ok[None, :])
            tl.atomic_xchg(count_ptr + pid_n, 0)


class SwappedLinear:
    """Scratch (float32 partials, zeroed counters) for _swapped_kernel, reused by every call."""

    def __init__(self, max_elements: int, device):
        self.partials = torch.empty(max_elements, device=device, dtype=torch.float32)
        self.counts = torch.zeros(1 << 16, device=device, dtype=torch.int32)
        self.descriptors = {}

    def __call__(self, x, w, block_n, block_k, warps, stages, split):
        m, k = x.shape
        n = w.shape[0]
        pdl = pdl_enabled(x)
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
        _swapped_kernel[(n // block_n, split)](x, w, out, self.partials, self.counts, m, n, k, k // split,
                                               PDL=pdl, SPLIT=split, BLOCK_M=16, BLOCK_N=block_n,
                                               BLOCK_K=block_k, num_warps=warps, num_stages=stages,
                                               **launch_options(pdl))
        return out

    def tma(self, x, w, block_n, block_k, warps, stages, split):
        m, k = x.shape
        n = w.shape[0]
        pdl = pdl_enabled(x)
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
        key = (w.data_ptr(), block_n, block_k)
        if key not in self.descriptors:
            self.descriptors[key] = TensorDescriptor.from_tensor(w, [block_n, block_k])
        _swapped_tma_kernel[(n // block_n, split)](x, self.descriptors[key], out, self.partials, self.counts, m, n,
                                                   k, k // split, PDL=pdl, SPLIT=split, BLOCK_M=16,
                                                   BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                                                   num_stages=stages, **launch_options(pdl))
        return out


def dot_linear(x, w, block_n, block_k, warps, stages, split):
    """x [M, K] @ w[N, K]^T for N % block_n == 0 and K % (block_k * split) == 0."""
    m, k = x.shape
    n = w.shape[0]
    pdl = pdl_enabled(x)
    out = torch.zeros(m, n, device=x.device, dtype=torch.float32) if split > 1 else torch.empty(
        m, n, device=x.device, dtype=x.dtype)
    _dot_kernel[(n // block_n, split)](x, w, out, m, n, k, k // split, PDL=pdl, SPLIT=split > 1,
                                       BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                                       num_stages=stages, **launch_options(pdl))
    return out.to(x.dtype) if split > 1 else out


def graph_us(fn, count):
    return 1000 * graph_replay_ms(fn)[0] / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="fewer configs")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="default: all five")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_verify_gemm.py needs a CUDA device")
    os.makedirs(args.out_dir, exist_ok=True)
    dot_configs = list(itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (3, 5), (1, 2)))
    swapped_configs = [c for c in itertools.product((64, 128), (64, 128, 256), (4, 8), (3, 4, 6), (1, 2, 4))
                       if c[0] * c[1] * 2 * c[3] <= 160 << 10]  # shared memory for the stages
    tma_configs = []
    if args.quick:  # 64-row tiles, split 4 for layers of few tiles (o, down), else none
        dot_configs = []
        swapped_configs = [(64, bk, warps, stages, None) for bk in (128, 256) for warps in (4, 8)
                           for stages in (3, 4) if not (bk == 256 and stages == 4 and warps == 8)]
        tma_configs = list(swapped_configs)
    shapes = {name: SHAPES[name] for name in args.shapes} if args.shapes else SHAPES
    result = {"rows": args.rows, "timing": "median us per product, 8 back to back in a CUDA graph", "shapes": {}}
    for name, (n, k) in shapes.items():
        count = 2 if name == "lm_head" else 8
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(count)]
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        expected = F.linear(x.float(), ws[0].float())
        swapped = SwappedLinear(4 * args.rows * n, x.device)
        row = {"cublas": graph_us(lambda: [F.linear(x, w) for w in ws], count)}
        kernels = [("dot", c, lambda x, w, c: dot_linear(x, w, *c)) for c in dot_configs]
        kernels += [("swapped", c, lambda x, w, c: swapped(x, w, *c)) for c in swapped_configs]
        kernels += [("tma", c, lambda x, w, c: swapped.tma(x, w, *c)) for c in tma_configs]
        for kind, (block_n, block_k, warps, stages, split), run in kernels:
            if split is None:
                split = 4 if 2 * (n // block_n) <= torch.cuda.get_device_properties(0).multi_processor_count else 1
            if n % block_n or k % (block_k * split):
                continue
            config = (block_n, block_k, warps, stages, split)
            tag = f"{kind}_bn{block_n}_bk{block_k}_w{warps}_s{stages}_split{split}"
            try:
                err = (run(x, ws[0], config).float() - expected).abs().max()
                if err > 0.05 * expected.abs().max():
                    row[tag] = f"wrong: max error {err:.3g}"
                    continue
                row[tag] = graph_us(lambda: [run(x, w, config) for w in ws], count)
            except Exception as e:  # noqa: BLE001 (a config that does not compile or fit is reported)
                row[tag] = f"{type(e).__name__}: {e}"[:200]
        timed = {tag: us for tag, us in row.items() if isinstance(us, float) and tag != "cublas"}
        best = min(timed, key=timed.get) if timed else None
        print(f"{name:8} M={args.rows} cuBLAS {row['cublas']:.1f} us, best {best} {timed.get(best, float('nan')):.1f} us",
              flush=True)
        result["shapes"][name] = row
        ws.clear()
    write_result(args.out_dir, "bench_verify_gemm", "verify_gemm", result)


if __name__ == "__main__":
    main()
