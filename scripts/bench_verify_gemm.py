"""Experiment for the verify step's linears: can a tensor-core kernel with programmatic dependent
launch beat cuBLAS on a few rows (a verify of k + 1 = 4 tokens at batch 1)?

The batch-1 GEMV (layers/small_m_gemm.py) wins at one row but loses from two rows on, so a verify
step still runs cuBLAS (4.74 ms for Llama-8B against 4.35 for a decode step on the H200). This
script sweeps a tl.dot kernel over tile shapes: x padded to 16 rows, BLOCK_N rows of W per program,
BLOCK_K-wide pipelined tiles, optional split-K (float32 partial sums added by atomics into a zeroed
float32 buffer, then cast: not deterministic, fine for an experiment), each program loading its
first weight tile before waiting for the kernel before it. Each config runs as 8 back-to-back
products over distinct weights in one CUDA graph (weights streamed from HBM), us per product,
against cuBLAS the same way, and is checked against a float32 product.

    python scripts/bench_verify_gemm.py OUT_DIR [--rows 4] [--quick]
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_result import graph_replay_ms, write_result  # noqa: E402
from foretell.layers.pdl import launch_options, let_next_kernel_launch, pdl_enabled, wait_for_previous_kernel  # noqa: E402

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
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_verify_gemm.py needs a CUDA device")
    os.makedirs(args.out_dir, exist_ok=True)
    configs = list(itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (3, 5), (1, 2)))
    if args.quick:
        configs = [c for c in configs if c[3] == 3 and c[2] == 4]
    result = {"rows": args.rows, "timing": "median us per product, 8 back to back in a CUDA graph", "shapes": {}}
    for name, (n, k) in SHAPES.items():
        count = 2 if name == "lm_head" else 8
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(count)]
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        expected = F.linear(x.float(), ws[0].float())
        row = {"cublas": graph_us(lambda: [F.linear(x, w) for w in ws], count)}
        for block_n, block_k, warps, stages, split in configs:
            if n % block_n or k % (block_k * split):
                continue
            tag = f"bn{block_n}_bk{block_k}_w{warps}_s{stages}_split{split}"
            try:
                err = (dot_linear(x, ws[0], block_n, block_k, warps, stages, split).float() - expected).abs().max()
                if err > 0.05 * expected.abs().max():
                    row[tag] = f"wrong: max error {err:.3g}"
                    continue
                row[tag] = graph_us(lambda: [dot_linear(x, w, block_n, block_k, warps, stages, split) for w in ws], count)
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
