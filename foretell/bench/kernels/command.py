"""`foretell bench kernels`: its flags and the command. Importing this module is cheap (no torch);
the kernels load when the command runs."""

from __future__ import annotations

import argparse

KERNEL_NAMES = ("attention_decode", "attention_verify", "attention_prefill", "mla_decode", "mla_verify", "moe",
                "moe_int4", "gemm_small_m", "gemm_fp8", "rms_norm", "rope", "silu_and_mul")  # run.KERNELS' keys

DESCRIPTION = """\
Time foretell's kernels at the shapes of the models that run them, on this device: each kernel's
engine entry point ("foretell": the Triton kernel on CUDA, the torch twin elsewhere) against its
plain-torch twin and what it replaces (SDPA on a dense cache, cuBLAS at bf16, bf16 experts), with
the largest difference from the reference, time per call (CUDA events, eager; and CUDA-graph
replays where the path may be captured; perf_counter on the CPU), GB/s and TFLOP/s. On CUDA each
timed run cycles over copies of the weights or caches that together outsize L2. Example:

  foretell bench kernels --kernels attention_decode,gemm_small_m --preset quick --output-json k.json

Presets: full (Llama-3.1-8B attention, linears and layer ops; DeepSeek-V2-Lite / V3 MLA and
experts; Kimi-K2.5's int4 experts; DeepSeek-V3's FP8 linears), quick (fewer batches), tiny (toy
widths: the CPU). Kernels: """ + ", ".join(KERNEL_NAMES) + "."


def add_kernels_parser(modes) -> None:
    p = modes.add_parser("kernels", help="time foretell's kernels at model shapes",
                         description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default=",".join(KERNEL_NAMES),
                   help="comma-separated kernels to time (default: all)")
    p.add_argument("--preset", choices=["auto", "full", "quick", "tiny"], default="auto",
                   help="shapes: auto is full on CUDA, tiny on the CPU (default: %(default)s)")
    p.add_argument("--device", dest="kernels_device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--dtype", dest="kernels_dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="the kernels' activation and weight dtype (default: bfloat16)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs before timing")
    p.add_argument("--iters", type=int, default=20, help="timed runs; the median is reported")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="time eagerly only (no CUDA-graph replays)")
    p.add_argument("--output-json", dest="kernels_output_json", help="write the full report here")
    p.set_defaults(func=run_kernels_command)


def run_kernels_command(args: argparse.Namespace) -> int:
    from foretell.bench.kernels.run import KernelBenchSettings, format_rows, run_kernel_bench
    from foretell.bench.report import write_json

    settings = KernelBenchSettings(
        kernels=[k.strip() for k in args.kernels.split(",") if k.strip()], device=args.kernels_device,
        dtype=args.kernels_dtype, preset=args.preset, warmup=args.warmup, iters=args.iters,
        cuda_graph=args.cuda_graph,
    )
    report = run_kernel_bench(settings, on_row=lambda row: print(format_rows([row]).splitlines()[-1], flush=True))
    print(f"\nforetell bench kernels: {report['device']}, {report['dtype']}, preset {report['preset']}, "
          f"torch {report['torch']}, triton {report['triton']}, commit {report['commit']}\n")
    print(format_rows(report["rows"]))
    failed = [f"{r['kernel']} {name}" for r in report["rows"] for name, p in r["paths"].items() if "error" in p]
    if failed:
        print(f"\n{len(failed)} paths failed (see their rows): {', '.join(sorted(set(failed)))}")
    if args.kernels_output_json:
        write_json(args.kernels_output_json, report)
        print(f"\nwrote {args.kernels_output_json}")
    return 0
