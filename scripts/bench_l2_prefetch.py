"""Does reading a weight into L2 ahead of its GEMM (on a side stream, while small latency-bound
kernels run) make a batch-1 decode GEMM faster? An experiment for the 8B decode step, where
the o_proj GEMM (33.5 MB) reads at 2.5 TB/s from HBM and the attention before it leaves HBM idle.

Measures, for Llama-3.1-8B linear shapes at one row (bf16):
  cold      the GEMM after L2 was flushed (a decode step's case today);
  warm      the GEMM right after a prefetch kernel read its weight (upper bound of the gain);
  overlap   a graph of [a ~10 us stand-in for attention on the main stream || the prefetch on a
            side stream] then the GEMM, against the same graph without the prefetch.
    python scripts/bench_l2_prefetch.py OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = {"o 4096x4096": (4096, 4096), "qkv 6144x4096": (6144, 4096), "down 4096x14336": (4096, 14336),
          "v2lite qkv_a 3648x2048": (3648, 2048), "v2lite o 2048x2048": (2048, 2048)}


@triton.jit
def _prefetch_kernel(x_ptr, sink_ptr, numel, BLOCK: tl.constexpr):
    # Persistent programs stride over the tensor; the loaded values feed a store that never
    # happens (the sum of finite weights is never NaN), so the loads are not optimised away.
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(tl.program_id(0) * BLOCK, numel, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < numel, other=0.0, eviction_policy="evict_last").to(tl.float32)
    total = tl.sum(acc, axis=0)
    tl.store(sink_ptr, total, mask=total != total)


def prefetch(x: torch.Tensor, sink: torch.Tensor, programs: int, block: int = 4096) -> None:
    _prefetch_kernel[(programs,)](x, sink, x.numel(), BLOCK=block, num_warps=8)


@triton.jit
def _spin_kernel(x_ptr, n, ITERS: tl.constexpr):
    # A few programs doing dependent latency-bound work, as attention at batch 1 does.
    offs = tl.arange(0, 128)
    v = tl.load(x_ptr + offs)
    for _ in range(ITERS):
        v = tl.load(x_ptr + ((offs + v.to(tl.int32)) % n))
    tl.store(x_ptr + offs, v)


def timed(fn, reps: int = 50) -> float:
    """Median device microseconds of fn()."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000)
    samples.sort()
    return samples[len(samples) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    flush = torch.empty(400 * 2**20, dtype=torch.uint8, device=dev)
    sink = torch.zeros(1, device=dev)
    spin_buf = torch.zeros(1 << 20, device=dev)
    results = {"gpu": torch.cuda.get_device_name(), "shapes": {}}
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=dev)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02
        xi = x[:, :k].contiguous() if k <= 4096 else torch.randn(1, k, dtype=torch.bfloat16, device=dev)
        row = {"mb": w.numel() * 2 / 1e6}
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))

        def gemm_after(before, reps=30):
            samples = []
            for _ in range(reps):
                flush.fill_(1)
                before()
                mid.record()
                F.linear(xi, w)
                end.record()
                end.synchronize()
                samples.append(mid.elapsed_time(end) * 1000)
            samples.sort()
            return samples[len(samples) // 2]

        row["cold_us"] = gemm_after(lambda: None)
        for programs in (66, 132, 264):
            row[f"warm_us_p{programs}"] = gemm_after(lambda: prefetch(w, sink, programs))
            row[f"prefetch_us_p{programs}"] = timed(lambda: prefetch(w, sink, programs))
        # The overlap graph: spin (stand-in for rope + attention) || prefetch, then the GEMM.
        side = torch.cuda.Stream()
        for programs in (0, 32, 66):
            g = torch.cuda.CUDAGraph()
            out = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
            _spin_kernel[(8,)](spin_buf, spin_buf.numel(), ITERS=12)
            prefetch(w, sink, max(programs, 1))
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                main = torch.cuda.current_stream()
                if programs:
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        prefetch(w, sink, programs)
                _spin_kernel[(8,)](spin_buf, spin_buf.numel(), ITERS=12)
                if programs:
                    main.wait_stream(side)
                torch.matmul(xi, w.t(), out=out)

            def run_graph():
                flush.fill_(1)
                start.record()
                g.replay()
                end.record()
                end.synchronize()
                return start.elapsed_time(end) * 1000

            samples = sorted(run_graph() for _ in range(30))
            row[f"graph_spin_gemm_us_prefetch{programs}"] = samples[15]
        spin_only = torch.cuda.CUDAGraph()
        with torch.cuda.graph(spin_only):
            _spin_kernel[(8,)](spin_buf, spin_buf.numel(), ITERS=12)
        row["spin_alone_us"] = timed(spin_only.replay)
        results["shapes"][name] = row
        print(name, json.dumps({k: round(v, 2) for k, v in row.items()}), flush=True)
    json.dump(results, open(os.path.join(args.out, "bench_l2_prefetch.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
