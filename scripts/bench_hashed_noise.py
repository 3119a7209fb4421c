"""Times the padded step's Exp(1) race with counter-based noise on a CUDA device, torch against the
Triton kernels (issue 31), and prints a table (and writes JSON with --out).

    python scripts/bench_hashed_noise.py [--vocab 128256] [--rows 32,64,128,256,512,1024] [--out FILE]

Columns, per number of rows n * (k + 1), milliseconds per call (CUDA events, median of --iters):
  torch noise      hashed_noise.hashed_exponential_torch: the twin's integer passes and float64 log
  kernel noise     triton_hashed_noise.hashed_exponential_triton: the same values in one kernel
  torch race       argmax_rows(probs / twin noise): the race before issue 31 (with the twin's noise)
  kernel+argmax    argmax_rows(probs / kernel noise): the noise kernel, then divide and argmax
  fused race       exponential_race_triton: hash, log, divide and argmax in two kernels, no noise tensor
The fused race's tokens are checked against the torch race's at every size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from foretell.layers.sampler import argmax_rows  # noqa: E402
from foretell.ops.sampling import hashed_noise  # noqa: E402
from foretell.ops.sampling import triton_hashed_noise as kernels  # noqa: E402


def _time_ms(fn, iters: int) -> float:
    fn()  # compile and warm up
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--rows", default="32,64,128,256,512,1024", help="comma-separated row counts")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", help="write the table as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_hashed_noise.py needs a CUDA device")
    device = torch.device("cuda")
    row_counts = [int(r) for r in args.rows.split(",")]
    if any(r < 1 for r in row_counts) or args.vocab < 1:
        raise SystemExit(f"--rows must be positive integers and --vocab >= 1, got {args.rows!r}, {args.vocab}")
    vocab = args.vocab
    results = []
    print(f"vocab {vocab}, {torch.cuda.get_device_name(device)}, ms per call (median of {args.iters})")
    header = f"{'rows':>6} {'torch noise':>12} {'kernel noise':>13} {'torch race':>11} {'kernel+argmax':>14} {'fused race':>11} {'speed-up':>9}"
    print(header)
    for rows in row_counts:
        gen = torch.Generator(device=device).manual_seed(rows)
        probs = torch.softmax(torch.randn(rows, vocab, generator=gen, device=device) * 3, dim=-1)
        seeds = torch.randint(0, 2**62, (rows,), generator=gen, device=device)
        row = {
            "rows": rows,
            "torch_noise_ms": _time_ms(lambda: hashed_noise.hashed_exponential_torch(seeds, vocab), args.iters),
            "kernel_noise_ms": _time_ms(lambda: kernels.hashed_exponential_triton(seeds, vocab), args.iters),
            "torch_race_ms": _time_ms(
                lambda: argmax_rows(probs / hashed_noise.hashed_exponential_torch(seeds, vocab)), args.iters),
            "kernel_argmax_ms": _time_ms(
                lambda: argmax_rows(probs / kernels.hashed_exponential_triton(seeds, vocab)), args.iters),
            "fused_race_ms": _time_ms(lambda: kernels.exponential_race_triton(probs, seeds), args.iters),
        }
        fused = kernels.exponential_race_triton(probs, seeds)
        row["tokens_equal"] = bool(torch.equal(fused, argmax_rows(probs / hashed_noise.hashed_exponential_torch(seeds, vocab))))
        row["speed_up"] = row["torch_race_ms"] / row["fused_race_ms"]
        results.append(row)
        print(f"{rows:>6} {row['torch_noise_ms']:>12.3f} {row['kernel_noise_ms']:>13.3f} {row['torch_race_ms']:>11.3f} "
              f"{row['kernel_argmax_ms']:>14.3f} {row['fused_race_ms']:>11.3f} {row['speed_up']:>8.1f}x"
              + ("" if row["tokens_equal"] else "  TOKENS DIFFER"))
        del probs, seeds
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"vocab": vocab, "device": torch.cuda.get_device_name(device), "rows": results}, f, indent=2)
    if not all(r["tokens_equal"] for r in results):
        raise SystemExit("the fused race's tokens differ from the torch race's")


if __name__ == "__main__":
    main()
