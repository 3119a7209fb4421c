"""Time the fused Triton kernels (ops/pointwise/triton_kernels.py) against the torch paths they replace.

Llama-3.1-8B / Qwen3-8B shapes (hidden 4096, 32 query / 8 kv heads, head_dim 128, intermediate
14336 / 12288), q and k as strided views into the fused qkv output as the model makes them:
  add_rms_norm   residual + x, then RMSNorm (twice per layer)
  qk_norm        Qwen3's per-head q_norm and k_norm (two norm calls)
  rope           neox RoPE on q and k, llama3-scaled cos/sin table read by position
  silu_and_mul   silu(gate) * up on the [n, 2 * intermediate] gate_up output (silu_qwen3: 12288)
  layer_llama    2 x add_rms_norm + rope + silu_and_mul (what one Llama decoder layer runs)
  layer_qwen3    layer_llama + qk_norm
"graph us" replays the calls inside a CUDA graph (triton.testing.do_bench_cudagraph: no launch
cost, as the engine's decode graph runs them); "eager us" is do_bench (launch cost included,
L2 flushed). "kernels" counts the CUDA kernels one call launches (torch profiler). The
"x32 layers" line scales layer_llama's saving to the 32 layers of Llama-3.1-8B.

    python scripts/bench_fused.py [OUT_DIR] [--dtype bf16] [--batches 1 64] [--quick]

Prints a table and, given OUT_DIR, writes OUT_DIR/bench_fused.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_result import write_result  # noqa: E402
from foretell.layers.norm import RMSNorm  # noqa: E402
from foretell.layers.rotary import RotaryEmbedding  # noqa: E402

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4096, 32, 8, 128
INTERMEDIATE = {"llama": 14336, "qwen3": 12288}
NUM_LAYERS = 32
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# The small ops of one decoder layer, by op name.
LAYERS = {
    "layer_llama": ["add_rms_norm", "add_rms_norm", "rope", "silu_and_mul"],
    "layer_qwen3": ["add_rms_norm", "add_rms_norm", "qk_norm", "rope", "silu_qwen3"],
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE = torch.device("cuda")


def build_ops(batch: int, dtype: torch.dtype):
    """name -> (torch_fn, fused_fn), each returning its outputs as a tuple."""
    from foretell.ops.pointwise import triton_kernels as fk

    def rand(*shape):
        return torch.randn(*shape, device=DEVICE).to(dtype)

    norm = RMSNorm(HIDDEN, 1e-5, dtype=dtype, device=DEVICE)
    head_norm = RMSNorm(HEAD_DIM, 1e-6, dtype=dtype, device=DEVICE)
    rotary = RotaryEmbedding(HEAD_DIM, 131072, 500000.0, LLAMA3_SCALING, device=DEVICE)
    x, residual = rand(batch, HIDDEN), rand(batch, HIDDEN)
    q_width, kv_width = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = rand(batch, q_width + 2 * kv_width)
    q = qkv[:, :q_width].view(batch, NUM_HEADS, HEAD_DIM)
    k = qkv[:, q_width : q_width + kv_width].view(batch, NUM_KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, 131072, (batch,), device=DEVICE)
    gate_up = {name: rand(batch, 2 * size) for name, size in INTERMEDIATE.items()}

    def norm_torch(a, r, layer=norm):
        summed = r + a
        return layer._norm(summed), summed

    def rope_torch():
        cos, sin = rotary.cos_sin(positions)
        return rotary._rotate(q, cos, sin), rotary._rotate(k, cos, sin)

    def silu_torch(model):
        gate, up = gate_up[model].chunk(2, dim=-1)
        return (F.silu(gate) * up,)

    ops = {
        "add_rms_norm": (lambda: norm_torch(x, residual),
                         lambda: fk.rms_norm_triton(x, norm.weight, norm.eps, residual)),
        "qk_norm": (lambda: (head_norm._norm(q), head_norm._norm(k)),
                    lambda: (fk.rms_norm_triton(q, head_norm.weight, head_norm.eps)[0],
                             fk.rms_norm_triton(k, head_norm.weight, head_norm.eps)[0])),
        "rope": (rope_torch,
                 lambda: fk.rope_triton(positions, q, k, rotary.cos_cache, rotary.sin_cache)),
        "silu_and_mul": (lambda: silu_torch("llama"),
                         lambda: (fk.silu_and_mul_triton(gate_up["llama"]),)),
        "silu_qwen3": (lambda: silu_torch("qwen3"),
                       lambda: (fk.silu_and_mul_triton(gate_up["qwen3"]),)),
    }

    def chain(parts, path):
        return lambda: tuple(out for part in parts for out in ops[part][path]())

    for name, parts in LAYERS.items():
        ops[name] = (chain(parts, 0), chain(parts, 1))
    return ops


def count_kernels(fn) -> int | None:
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:  # a profiler without CUPTI: leave the column empty
        return None


def bench(batch: int, dtype: torch.dtype, rep: int) -> list[dict]:
    from triton.testing import do_bench, do_bench_cudagraph

    rows = []
    with torch.inference_mode():
        for name, (torch_fn, fused_fn) in build_ops(batch, dtype).items():
            expected, got = torch_fn(), fused_fn()  # also compiles the kernels
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(expected, got))
            row = dict(op=name, batch=batch, max_abs_err=err)
            for path, fn in (("torch", torch_fn), ("fused", fused_fn)):
                row[f"{path}_graph_us"] = do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3
                row[f"{path}_eager_us"] = do_bench(fn, rep=rep, return_mode="median") * 1e3
                row[f"{path}_kernels"] = count_kernels(fn)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", help="folder to write bench_fused.json into")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--quick", action="store_true", help="shorter timing")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fused.py needs a CUDA device")
    import triton

    rep = 20 if args.quick else 100
    print(f"{torch.cuda.get_device_name()}  {args.dtype}  torch {torch.__version__}  "
          f"triton {triton.__version__}")
    header = (f"{'op':13} {'batch':>5} {'torch graph us':>15} {'fused graph us':>15} {'saved':>7} "
              f"{'torch eager us':>15} {'fused eager us':>15} {'kernels':>8} {'max err':>8}")
    print(header)
    print("-" * len(header))
    rows = []
    for batch in args.batches:
        for r in bench(batch, DTYPES[args.dtype], rep):
            rows.append(r)
            kernels = f"{r['torch_kernels']}->{r['fused_kernels']}" if r["torch_kernels"] else "?"
            print(f"{r['op']:13} {r['batch']:>5} {r['torch_graph_us']:>15.1f} "
                  f"{r['fused_graph_us']:>15.1f} {r['torch_graph_us'] - r['fused_graph_us']:>7.1f} "
                  f"{r['torch_eager_us']:>15.1f} {r['fused_eager_us']:>15.1f} {kernels:>8} "
                  f"{r['max_abs_err']:>8.1e}", flush=True)
            if r["op"] == "layer_llama":
                saved = (r["torch_graph_us"] - r["fused_graph_us"]) * NUM_LAYERS / 1e3
                print(f"{'':13} {'':>5} x{NUM_LAYERS} layers: {saved:.2f} ms saved per step (graph)")
    if not args.out_dir:
        return
    write_result(args.out_dir, "bench_fused", "fused_kernels", {
        "dtype": args.dtype,
        "shapes": dict(hidden=HIDDEN, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                       head_dim=HEAD_DIM, intermediate=INTERMEDIATE),
        "timing": "median of triton.testing.do_bench_cudagraph / do_bench, microseconds",
        "rows": rows,
    })


if __name__ == "__main__":
    main()
