"""Which kernel runs a 4-row linear (the EAGLE3 k = 3 verify at batch 1) as fast as the 1-row GEMV
runs a decode? A sweep at the Llama-3.1-8B shapes, against the engine's choices.

Candidates at M = 4 (bf16, weights streamed past L2, each call in a CUDA graph as in
scripts/bench_small_m_gemm.py):
  - mma:    ops/gemm/triton_mma.py with its default tiles (the engine's choice), and with 16 or 32
            rows of W per program (mma.sync tiles instead of a 64-row wgmma: more programs);
  - regdot: tensor cores fed like the GEMV: W tiles loaded straight to registers, the next tile
            requested before the current one is multiplied (no shared-memory pipeline);
  - lanes:  a CUDA-core GEMV that keeps a float32 accumulator per (row of x, row of W, K lane) and
            reduces across lanes once at the end (the engine's GEMV reduces every tile, per row);
  - gemv:   ops/gemm/triton_gemv.py at M = 4 (its per-row passes);
and the engine's 1-row GEMV at M = 1: the time to match.

    python scripts/sweep_few_rows.py OUT_DIR [--rows 4] [--quick] [--families regdot mma lanes] [--shapes ...]

Measured on the H200 (BENCHMARKS.md, eleventh session): the lanes GEMV took 1.6-2x the MMA's time
at every shape (its FMAs, not its loads, bound it); 16- and 32-row MMA tiles were no faster.
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

from bench_result import write_result  # noqa: E402
from foretell.ops.gemm import triton_gemv, triton_mma  # noqa: E402
from foretell.ops.common.pdl import launch_options, let_next_kernel_launch, pdl_enabled, wait_for_previous_kernel  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
STREAM_BYTES = 384 << 20


@triton.jit
def _lanes_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, PDL: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of W
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    lanes = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + cols[:, None].to(tl.int64) * K + lanes[None, :]  # [BLOCK_N, BLOCK_K]
    x_tile = x_ptr + rows[:, None] * stride_xm + lanes[None, :]  # [BLOCK_M, BLOCK_K]
    w = tl.load(w_tile, mask=col_ok[:, None] & (lanes < K)[None, :], other=0.0, eviction_policy="evict_first")
    wait_for_previous_kernel(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_next = k0 + BLOCK_K  # the next tile requested before this one is used
        w_next = tl.load(w_tile + k_next, mask=col_ok[:, None] & ((k_next + lanes) < K)[None, :], other=0.0,
                         eviction_policy="evict_first")
        x = tl.load(x_tile + k0, mask=(rows < M)[:, None] & ((k0 + lanes) < K)[None, :], other=0.0).to(tl.float32)
        acc += w.to(tl.float32)[None, :, :] * x[:, None, :]
        w = w_next
    let_next_kernel_launch(PDL)
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    out = out_ptr + rows[:, None] * N + cols[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & col_ok[None, :])


@triton.jit
def _regdot_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, PDL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tensor cores with the GEMV's loads: W tiles go straight to registers, the next one requested
    before the current one is multiplied (no shared-memory pipeline: num_stages=1)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of W
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    lanes = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + cols[:, None].to(tl.int64) * K + lanes[None, :]  # [BLOCK_N, BLOCK_K]
    x_tile = x_ptr + rows[None, :] * stride_xm + lanes[:, None]  # [BLOCK_K, BLOCK_M]
    w = tl.load(w_tile, mask=col_ok[:, None] & (lanes < K)[None, :], other=0.0, eviction_policy="evict_first")
    wait_for_previous_kernel(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_next = k0 + BLOCK_K
        w_next = tl.load(w_tile + k_next, mask=col_ok[:, None] & ((k_next + lanes) < K)[None, :], other=0.0,
                         eviction_policy="evict_first")
        x = tl.load(x_tile + k0, mask=((k0 + lanes) < K)[:, None] & (rows < M)[None, :], other=0.0)
        acc = tl.dot(w, x, acc)
        w = w_next
    let_next_kernel_launch(PDL)
    out = out_ptr + rows[None, :] * N + cols[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=col_ok[:, None] & (rows < M)[None, :])


def regdot_linear(x, w, block_n, block_k, warps):
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    pdl = pdl_enabled(x)
    _regdot_kernel[(triton.cdiv(n, block_n),)](x, w, out, m, n, k, x.stride(0), PDL=pdl, BLOCK_M=16,
                                                BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=1,
                                                **launch_options(pdl))
    return out


def lanes_linear(x, w, block_n, block_k, warps):
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    pdl = pdl_enabled(x)
    _lanes_kernel[(triton.cdiv(n, block_n),)](x, w, out, m, n, k, x.stride(0), PDL=pdl,
                                               BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n,
                                               BLOCK_K=block_k, num_warps=warps, **launch_options(pdl))
    return out


def candidates(m: int, n: int, k: int, device, quick: bool, families: list[str]) -> dict:
    """name -> fn(x, w)."""
    paths = {"cublas": lambda x, w: F.linear(x, w)}
    mma = triton_mma.pick_config(m, n, k, device)
    paths[f"engine {mma}"] = lambda x, w: triton_mma.small_m_mma_linear(x, w, None, mma)
    if "regdot" in families:
        for block_n, block_k, warps in itertools.product((16, 32, 64), (256, 512, 1024, 2048), (4, 8, 16)):
            if block_n * block_k * 2 > 1024 * 32 * warps or block_n * block_k < 32 * 32 * warps:
                continue  # W tile per thread: 8 to 64 registers' worth, twice for the prefetch
            paths[f"regdot BN{block_n} BK{block_k} w{warps}"] = (
                lambda x, w, c=(block_n, block_k, warps): regdot_linear(x, w, *c))
    if "mma" not in families:
        return paths
    for block_n, block_k, warps, stages in itertools.product((16, 32), (256, 512), (2, 4), (3, 4)):
        if quick and (warps, stages) != (4, 3):
            continue
        config = triton_mma.MmaConfig(block_k, mma.split, stages, block_n, warps)
        paths[str(config)] = lambda x, w, c=config: triton_mma.small_m_mma_linear(x, w, None, c)
    if "lanes" not in families:
        return paths
    for block_n, block_k, warps in itertools.product((4, 8, 16), (256, 512, 1024, 2048), (4, 8)):
        if m * block_n * block_k > 128 * 32 * warps or (quick and warps != 8):  # accumulators <= 128 / thread
            continue
        paths[f"lanes BN{block_n} BK{block_k} w{warps}"] = (
            lambda x, w, c=(block_n, block_k, warps): lanes_linear(x, w, *c))
    for block_n in (2, 4, 8):
        config = triton_gemv.pick_config(m, n, k, block_n=block_n)
        paths[f"gemv {config}"] = lambda x, w, c=config: triton_gemv.small_m_linear(x, w, None, c)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--families", nargs="*", default=["regdot", "mma", "lanes"],
                        help="candidate families beside the engine's MMA and cuBLAS (default all)")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    from triton.testing import do_bench_cudagraph

    device = torch.device("cuda")
    dtype = torch.bfloat16
    results = {}
    for name in args.shapes:
        n, k = SHAPES[name]
        copies = max(1, -(-STREAM_BYTES // (n * k * 2)))
        weights = [(torch.randn(n, k, device=device) / k**0.5).to(dtype) for _ in range(copies)]
        x1 = torch.randn(1, k, device=device).to(dtype)
        gemv1 = triton_gemv.pick_config(1, n, k)
        row = {"gemv M=1": do_bench_cudagraph(lambda: [triton_gemv.small_m_linear(x1, w, None, gemv1) for w in weights],
                                              rep=30, return_mode="median") * 1e3 / copies}
        x = torch.randn(args.rows, k, device=device).to(dtype)
        expected = F.linear(x.float(), weights[0].float())
        for path, fn in candidates(args.rows, n, k, device, args.quick, args.families).items():
            try:
                got = fn(x, weights[0]).float()
                if not torch.allclose(got, expected, atol=3e-2, rtol=3e-2):
                    row[path] = f"wrong: max err {(got - expected).abs().max().item():.3g}"
                    continue
                row[path] = do_bench_cudagraph(lambda: [fn(x, w) for w in weights], rep=30,
                                               return_mode="median") * 1e3 / copies
            except Exception as error:  # noqa: BLE001 - a config that does not compile is a result
                row[path] = f"failed: {type(error).__name__}: {str(error)[:120]}"
        results[name] = row
        timed = sorted((v, p) for p, v in row.items() if isinstance(v, float))
        print(f"{name} {n}x{k}: " + ", ".join(f"{p} {v:.1f}" for v, p in timed[:8]), flush=True)
        engine = next(v for p, v in row.items() if p.startswith("engine"))
        print(f"    engine MMA {engine:.1f} us, gemv M=1 {row['gemv M=1']:.1f} us", flush=True)
        del weights
    if args.out_dir:
        write_result(args.out_dir, "sweep_few_rows", "few-row linears at M = %d" % args.rows, {"us": results})


if __name__ == "__main__":
    main()
