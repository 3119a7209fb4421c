"""Time the few-row Triton kernels (ops/gemm/triton_kernels.py: the GEMV, the tensor-core MMA) against
cuBLAS (F.linear) at the linear shapes of Llama-3.1-8B, for the few rows of decode (M = batch) and
verify (M = batch x (k + 1)).

Shapes (N, K): qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336, lm_head
128256x4096. Each timed call runs the product over enough copies of the weight to exceed L2
(as a decode step streams its weights from HBM), inside a CUDA graph (no launch cost, as the
engine's decode graph runs them): triton.testing.do_bench_cudagraph, median, divided by the copies.
"GB/s" counts the bytes of W, x and y once. "triton" is the faster of the kernel's candidate
configs (the ones the engine's dispatch times); "auto" is what the dispatch (SmallMGemm, with its
own event timer) would pick. The "decode step" lines add up one Llama-8B step at M = 1 and 4:
32 x (qkv + o + gate_up + down) + lm_head.

    python scripts/bench_small_m_gemm.py [OUT_DIR] [--dtype bf16] [--rows 1 2 4 8 16] [--quick]

Prints a table and, given OUT_DIR, writes OUT_DIR/bench_small_m_gemm.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_result import write_result  # noqa: E402
from foretell.ops.gemm.dispatch import GemmKey, SmallMGemm  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
NUM_LAYERS = 32
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE = torch.device("cuda")
STREAM_BYTES = 384 << 20  # well past the 50-60 MiB L2 of an H100/H200


def bench_shape(name, n, k, rows, dtype, rep, gemm) -> list[dict]:
    from triton.testing import do_bench_cudagraph

    from foretell.ops.gemm import triton_kernels as kernels

    size = torch.tensor([], dtype=dtype).element_size()
    copies = max(1, -(-STREAM_BYTES // (n * k * size)))
    weights = [(torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype) for _ in range(copies)]
    results = []
    for m in rows:
        x = torch.randn(m, k, device=DEVICE).to(dtype)
        paths = {"cublas": lambda: [F.linear(x, w) for w in weights]}
        for config in kernels.candidate_configs(m, n, k, dtype, DEVICE):
            paths[config] = lambda c=config: [kernels.small_m_linear(x, w, None, c) for w in weights]
        us = {}
        for path, fn in paths.items():
            fn()  # compile
            us[path] = do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3 / copies
        expected = F.linear(x.float(), weights[0].float())
        configs = [p for p in paths if p != "cublas"]
        best = min(configs, key=us.get)
        err = (kernels.small_m_linear(x, weights[0], None, best).float() - expected).abs().max().item()
        choice = gemm.choose(GemmKey(m, n, k, dtype, False), weights[0], None)
        moved = (n * k + m * k + m * n) * size
        results.append(dict(
            shape=name, n=n, k=k, m=m, cublas_us=us["cublas"], triton_us=us[best],
            triton_config=str(best), all_triton_us={str(c): us[c] for c in configs},
            cublas_gbps=moved / us["cublas"] / 1e3, triton_gbps=moved / us[best] / 1e3,
            auto="cublas" if choice is None else str(choice), max_abs_err=err,
        ))
    return results


def step_totals(rows: list[dict]) -> dict[int, dict[str, float]]:
    """One decode step of Llama-8B at each M with all five shapes: cuBLAS vs best-of-both ms."""
    totals = {}
    for m in sorted({r["m"] for r in rows}):
        at_m = {r["shape"]: r for r in rows if r["m"] == m}
        if set(at_m) != set(SHAPES):
            continue
        count = {name: NUM_LAYERS for name in SHAPES} | {"lm_head": 1}
        cublas = sum(count[s] * r["cublas_us"] for s, r in at_m.items()) / 1e3
        best = sum(count[s] * min(r["cublas_us"], r["triton_us"]) for s, r in at_m.items()) / 1e3
        totals[m] = dict(cublas_ms=cublas, best_ms=best)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", help="folder to write bench_small_m_gemm.json into")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--rows", type=int, nargs="+", help="M values (default 1 2 4 8 16)")
    parser.add_argument("--quick", action="store_true", help="M 1 and 4, shorter timing")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_small_m_gemm.py needs a CUDA device")
    import triton

    rows = args.rows or ([1, 4] if args.quick else [1, 2, 4, 8, 16])
    rep = 10 if args.quick else 50
    dtype = DTYPES[args.dtype]
    print(f"{torch.cuda.get_device_name()}  {args.dtype}  torch {torch.__version__}  "
          f"triton {triton.__version__}")
    header = (f"{'shape':8} {'N':>6} {'K':>6} {'M':>3} {'cuBLAS us':>10} {'Triton us':>10} "
              f"{'cuBLAS GB/s':>12} {'Triton GB/s':>12} {'speedup':>8} {'auto':>6}  triton config")
    print(header)
    print("-" * len(header))
    gemm = SmallMGemm("auto")
    results = []
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            for r in bench_shape(name, n, k, rows, dtype, rep, gemm):
                results.append(r)
                auto = "cublas" if r["auto"] == "cublas" else "triton"
                print(f"{name:8} {n:>6} {k:>6} {r['m']:>3} {r['cublas_us']:>10.1f} {r['triton_us']:>10.1f} "
                      f"{r['cublas_gbps']:>12.0f} {r['triton_gbps']:>12.0f} "
                      f"{r['cublas_us'] / r['triton_us']:>7.2f}x {auto:>6}  {r['triton_config']}", flush=True)
            torch.cuda.empty_cache()  # the last shape's weight copies
    totals = step_totals(results)
    for m, t in totals.items():
        print(f"decode step (32 layers + lm_head) at M={m}: cuBLAS {t['cublas_ms']:.2f} ms, "
              f"best of both {t['best_ms']:.2f} ms")
    if not args.out_dir:
        return
    write_result(args.out_dir, "bench_small_m_gemm", "small_m_gemm", {
        "dtype": args.dtype,
        "timing": "median of triton.testing.do_bench_cudagraph per call, weights streamed past L2, us",
        "rows": results,
        "decode_step_ms": {str(m): t for m, t in totals.items()},
    })


if __name__ == "__main__":
    main()
