"""Sweep the low-precision decode kernels' launch configs on one H200 (issue 25's speed bars), in one process.

    python scripts/sweep_low_precision_gpu.py [--out DIR] [--only dense int4_moe fp8_moe] [--budget-s 210]

Sections:
  dense     the FP8 few-row linears (ops/gemm/triton_fp8_few_rows.py) at Llama-3.1-8B's shapes with
            128x128 blocks (what quantization="fp8" makes): qkv 6144x4096, o 4096x4096, gate_up
            28672x4096 (plain and gated: silu(gate) * up in the epilogue, as the MLP runs it),
            down 4096x14336, at M = 1 (decode) and 4 (an EAGLE3 k=3 verify); every
            candidate_configs entry (at M = 1 also 16 KiB GEMV tiles over four warps and the
            tensor-core MMA with 15 padding rows), and for reference the bf16 few-row kernel (mode
            "on"'s choice) and cuBLAS on a bf16 weight of the same shape;
  int4_moe  the int4 MoE GEMVs (ops/moe/triton_int4_gemv.py) at Kimi-K2.5's experts (H 7168, I 2048,
            8 of 384) at 1, 2, 4 and 8 tokens: gate_up configs with the default down, then down
            configs with the best gate_up;
  fp8_moe   the FP8 MoE GEMVs (ops/moe/fp8_triton_gemv.py) at DeepSeek-V3's (8 + 1 shared of 257,
            128x128 blocks) at 1 and 4 tokens, the same way.
Each candidate is checked against its torch twin first (a config that fails to compile or
disagrees is recorded and skipped), then timed as CUDA-graph replays with CUDA events
(foretell.bench.kernels.timing.time_kernel), over enough copies of the weights (dense) to outsize
L2, so the bytes come from HBM as in a decode step. Prints a table and the best config per shape
(with its fraction of the H200's 4.8 TB/s) and writes sweep_low_precision_gpu.json to --out
(default $OUT, or .). A section's candidates stop when its share of --budget-s has passed
(recorded as skipped), so the run ends in under 4 minutes.

--tiny runs the same code at toy shapes on whatever device torch picks (the CPU under
TRITON_INTERPRET=1): a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from foretell.bench.kernels.linear_kinds import close_error  # noqa: E402
from foretell.bench.kernels.timing import time_kernel  # noqa: E402
from foretell.ops.gemm import fp8_reference as fp8_ref  # noqa: E402
from foretell.ops.moe import int4_reference as int4_ref  # noqa: E402
from foretell.ops.moe.fp8_reference import fp8_experts_forward_torch  # noqa: E402
from foretell.ops.pointwise.reference import silu_and_mul_torch  # noqa: E402

H200_BYTES_S = 4.8e12
BLOCK = (128, 128)
L2_OUTSIZE_BYTES = 256 << 20  # dense weights repeated until one timed run reads this much
LLAMA8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TINY_DENSE = {"qkv": (384, 256), "gate_up": (512, 256), "down": (256, 640)}
KIMI = {"experts": 384, "top_k": 8, "hidden": 7168, "inter": 2048}
V3 = {"experts": 257, "top_k": 8, "hidden": 7168, "inter": 2048}  # 256 routed + the shared one, packed
TINY_MOE = {"experts": 12, "top_k": 3, "hidden": 256, "inter": 128}
INT4_GATE_UP = [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w}
                for bn, bk, w in ((4, 1024, 4), (2, 1024, 2), (4, 512, 2), (8, 512, 4), (8, 256, 2), (16, 256, 4),
                                  (16, 512, 8), (32, 256, 4), (32, 128, 4), (64, 128, 4), (64, 64, 2))]
INT4_DOWN = [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "SPLIT": split}
             for bn, bk, w, split in ((8, 256, 2, 8), (4, 512, 2, 8), (4, 256, 1, 8), (8, 512, 4, 8), (16, 256, 4, 8),
                                      (16, 128, 2, 8), (32, 128, 4, 8), (8, 256, 2, 4))]
FP8_GATE_UP = [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w}
               for bn, bk, w in ((16, 128, 4), (8, 128, 2), (8, 256, 4), (16, 256, 4), (32, 128, 4), (4, 512, 4),
                                 (8, 512, 8))]
FP8_DOWN = [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "SPLIT": split}
            for bn, bk, w, split in ((16, 128, 4, 8), (8, 128, 2, 8), (16, 256, 4, 8), (32, 128, 4, 8), (8, 256, 4, 8),
                                     (16, 128, 4, 4))]


class Budget:
    """Seconds left for candidates (once spent, candidates are recorded as skipped), and the timed
    runs per candidate (one, unwarmed, for --tiny's smoke test)."""

    def __init__(self, seconds: float, warmup: int = 3, iters: int = 20):
        self.deadline = time.perf_counter() + seconds
        self.warmup, self.iters = warmup, iters

    @property
    def spent(self) -> bool:
        return time.perf_counter() > self.deadline


def measure(fn, check, device, calls_per_run: int, budget: Budget, num_bytes: float) -> dict:
    """{"ok", "us", "fraction_of_bandwidth"} of fn (a run of calls_per_run calls), or why not."""
    if budget.spent:
        return {"ok": False, "skipped": "budget spent"}
    try:
        error = check()
        if error is not None:
            return {"ok": False, "error": error}
        timing = time_kernel(fn, device, warmup=budget.warmup, iters=budget.iters, calls_per_run=calls_per_run,
                             cuda_graph=device.type == "cuda")
    except Exception as e:  # noqa: BLE001  (a config that fails to compile or launch just loses)
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
    us = timing.median_us
    return {"ok": True, "us": round(us, 2), "fraction_of_bandwidth": round(num_bytes / (us * 1e-6) / H200_BYTES_S, 4)}


def best_of(rows: list[dict]) -> dict | None:
    timed = [r for r in rows if r.get("ok")]
    return min(timed, key=lambda r: r["us"]) if timed else None


def dense_section(device: torch.device, budget: Budget, tiny: bool) -> dict:
    from foretell.ops.gemm import triton_fp8_few_rows as few
    from foretell.ops.gemm import triton_kernels

    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    shapes = TINY_DENSE if tiny else LLAMA8B
    dtype = torch.float16 if tiny else torch.bfloat16  # (the interpreter's tl.dot on bf16 is broken)
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, generator=gen, device=device) / k**0.5
        q, s = fp8_ref.quantize_fp8_blocks(w, BLOCK)
        w_bf16 = w.to(dtype)
        del w
        copies = 1 if tiny else max(1, -(-L2_OUTSIZE_BYTES // q.numel()))
        weights = [(q, s)] + [(q.clone(), s.clone()) for _ in range(copies - 1)]
        bf16_weights = [w_bf16] + [w_bf16.clone() for _ in range(max(1, copies // 2) - 1)]
        fp8_bytes = q.numel() + s.numel() * 4
        for gated in ((False, True) if name == "gate_up" else (False,)):
            for m in (1, 4):
                x = torch.randn(m, k, generator=gen, device=device).to(dtype)
                twin = fp8_ref.fp8_linear_torch(x, q, s, BLOCK)  # [M, N]
                want = silu_and_mul_torch(twin) if gated else twin
                key = f"{name}{'_gated' if gated else ''} {n}x{k} M={m}"
                rows = []
                for config in few.candidate_configs(m, n, k, x.dtype, BLOCK, device):
                    def run(config=config):
                        for qi, si in weights:
                            few.fp8_few_rows_linear(x, qi, si, BLOCK, None, config, gated=gated)

                    def check(config=config):
                        # (gated: the projection's rounding differs by an ulp, then silu and the product
                        # round again: a few bf16 ulps of the largest value)
                        return close_error(few.fp8_few_rows_linear(x, q, s, BLOCK, None, config, gated=gated),
                                           want, 5e-2 if gated else 2e-2)

                    rows.append({"config": str(config), **measure(run, check, device, len(weights), budget,
                                                                   fp8_bytes)})
                result = {"candidates": rows, "default": rows[0], "best": best_of(rows)}
                # References in bf16 (twice the bytes): mode "on"'s few-row kernel and cuBLAS.
                bf16_bytes = w_bf16.numel() * 2
                bf16_config = triton_kernels.default_config(m, n, k, dtype, device)
                if bf16_config is not None:
                    result["bf16_kernel"] = {"config": str(bf16_config), **measure(
                        lambda: [triton_kernels.small_m_linear(x, wi, None, bf16_config, gated=gated)
                                 for wi in bf16_weights],
                        lambda: None, device, len(bf16_weights), budget, bf16_bytes)}
                result["bf16_cublas"] = measure(lambda: [F.linear(x, wi) for wi in bf16_weights], lambda: None,
                                                device, len(bf16_weights), budget, bf16_bytes)
                out[key] = result
        del weights, bf16_weights
    return out


def moe_inputs(shape: dict, tokens: int, device: torch.device, gen: torch.Generator, shared_slot: bool):
    """x [T, H], routing weights and ids [T, top_k (+1 for V3's shared expert)], shared [T, H]."""
    experts, top_k, hidden = shape["experts"], shape["top_k"], shape["hidden"]
    routed = experts - 1 if shared_slot else experts
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(torch.bfloat16)
    ids = torch.rand(tokens, routed, generator=gen, device=device).topk(top_k, dim=-1).indices
    if shared_slot:
        ids = torch.cat([ids, torch.full((tokens, 1), routed, device=device, dtype=ids.dtype)], dim=1)
    weights = torch.rand(tokens, ids.shape[1], generator=gen, device=device) * 2.5
    shared = torch.randn(tokens, hidden, generator=gen, device=device).to(torch.bfloat16)
    return x, weights, ids, shared


def sweep_moe(fused, reference, gate_up_configs, down_configs, num_bytes, device, budget) -> dict:
    """gate_up configs with the default down, then down configs with the best gate_up."""
    want = reference()

    def candidate(config):
        return {"config": config, **measure(lambda: fused(config), lambda: close_error(fused(config), want, 3e-2),
                                            device, 1, budget, num_bytes)}

    default = candidate(None)
    up_rows = [candidate({"gate_up": c}) for c in gate_up_configs]
    best_up = best_of(up_rows)
    up = {} if best_up is None else best_up["config"]
    down_rows = [candidate({**up, "down": c}) for c in down_configs]
    rows = [default, *up_rows, *down_rows]
    return {"default": default, "candidates": rows, "best": best_of(rows)}


def int4_moe_section(device: torch.device, budget: Budget, tiny: bool) -> dict:
    from foretell.ops.moe.triton_int4_gemv import fused_int4_experts_gemv_triton

    shape = TINY_MOE if tiny else KIMI
    gen = torch.Generator(device=device).manual_seed(1)
    experts, hidden, inter = shape["experts"], shape["hidden"], shape["inter"]

    def linear(n, k):
        packed = torch.randint(-2**31, 2**31 - 1, (experts, n, int4_ref.words(k)), generator=gen, device=device,
                               dtype=torch.int32)
        scale = ((torch.rand(experts, n, int4_ref.groups(k), generator=gen, device=device) + 0.5) / (4 * k**0.5))
        return packed, scale.to(torch.bfloat16)

    tensors = (*linear(2 * inter, hidden), *linear(hidden, inter))
    per_expert = sum(t[0].numel() * t.element_size() for t in tensors)
    out = {}
    for tokens in ((1, 2) if tiny else (1, 2, 4, 8)):
        x, weights, ids, shared = moe_inputs(shape, tokens, device, gen, shared_slot=False)
        num_bytes = ids.unique().numel() * per_expert
        out[f"kimi int4 T={tokens}"] = sweep_moe(
            lambda config: fused_int4_experts_gemv_triton(x, *tensors, weights, ids, shared, out_dtype=x.dtype,
                                                          config=config),
            lambda: (int4_ref.int4_experts_forward_torch(x, *tensors, weights, ids) + shared).to(x.dtype),
            INT4_GATE_UP if not tiny else INT4_GATE_UP[:2], INT4_DOWN if not tiny else INT4_DOWN[:2],
            num_bytes, device, budget)
    return out


def fp8_moe_section(device: torch.device, budget: Budget, tiny: bool) -> dict:
    from foretell.ops.moe.fp8_triton_gemv import fused_fp8_experts_gemv_triton

    shape = TINY_MOE if tiny else V3
    gen = torch.Generator(device=device).manual_seed(2)
    experts, hidden, inter = shape["experts"], shape["hidden"], shape["inter"]
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen, device=device).to(torch.float8_e4m3fn)
    gate_up_s = torch.rand(experts, -(-2 * inter // 128), -(-hidden // 128), generator=gen, device=device) / 200
    down = torch.randn(experts, hidden, inter, generator=gen, device=device).to(torch.float8_e4m3fn)
    down_s = torch.rand(experts, -(-hidden // 128), -(-inter // 128), generator=gen, device=device) / 100
    tensors = (gate_up, gate_up_s, down, down_s)
    per_expert = sum(t[0].numel() * t.element_size() for t in tensors)
    out = {}
    for tokens in ((1,) if tiny else (1, 4)):
        x, weights, ids, shared = moe_inputs(shape, tokens, device, gen, shared_slot=True)
        num_bytes = ids.unique().numel() * per_expert
        out[f"v3 fp8 T={tokens}"] = sweep_moe(
            lambda config: fused_fp8_experts_gemv_triton(x, *tensors, BLOCK, weights, ids, shared, config=config),
            lambda: (fp8_experts_forward_torch(x, *tensors, BLOCK, weights, ids) + shared).to(x.dtype),
            FP8_GATE_UP if not tiny else FP8_GATE_UP[:2], FP8_DOWN if not tiny else FP8_DOWN[:2],
            num_bytes, device, budget)
    return out


SECTIONS = {"dense": dense_section, "int4_moe": int4_moe_section, "fp8_moe": fp8_moe_section}
SHARES = {"dense": 0.5, "int4_moe": 0.35, "fp8_moe": 0.15}  # of --budget-s (normalized over those run)


def print_table(results: dict) -> None:
    print(f"\n{'section':<9} {'shape':<34} {'candidate':<58} {'us':>9} {'of 4.8TB/s':>10}")
    for section, shapes in results.items():
        if section.startswith("_") or "error" in shapes:
            continue
        for key, result in shapes.items():
            for row in result["candidates"]:
                value = f"{row['us']:9.2f} {row['fraction_of_bandwidth']:10.1%}" if row.get("ok") else \
                    f"  {row.get('error') or row.get('skipped')}"[:80]
                print(f"{section:<9} {key:<34} {str(row['config'])[:58]:<58} {value}")
            for ref in ("bf16_kernel", "bf16_cublas"):
                if ref in result and result[ref].get("ok"):
                    print(f"{section:<9} {key:<34} {ref:<58} {result[ref]['us']:9.2f} "
                          f"{result[ref]['fraction_of_bandwidth']:10.1%}")
    print(f"\n{'best per shape':<44} {'candidate':<58} {'us':>9} {'of 4.8TB/s':>10} {'default us':>10}")
    for section, shapes in results.items():
        if section.startswith("_") or "error" in shapes:
            continue
        for key, result in shapes.items():
            best, default = result["best"], result["default"]
            if best is None:
                print(f"{key:<44} (no candidate ran)")
                continue
            default_us = f"{default['us']:10.2f}" if default.get("ok") else "    failed"
            print(f"{key:<44} {str(best['config'])[:58]:<58} {best['us']:9.2f} {best['fraction_of_bandwidth']:10.1%} "
                  f"{default_us}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for sweep_low_precision_gpu.json")
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS), help="run these sections only")
    parser.add_argument("--budget-s", type=float, default=210.0,
                        help="seconds for all candidates together (shared among the sections run: SHARES)")
    parser.add_argument("--tiny", action="store_true", help="toy shapes on any device: a smoke test of the script")
    args = parser.parse_args()
    if args.budget_s <= 0:
        raise SystemExit(f"--budget-s must be positive, got {args.budget_s}")
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("sweep_low_precision_gpu.py needs a CUDA GPU (or --tiny for a smoke test)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.makedirs(args.out, exist_ok=True)
    names = args.only or list(SECTIONS)
    results: dict = {"_device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    for name in names:
        t0 = time.perf_counter()
        share = SHARES[name] / sum(SHARES[n] for n in names)
        budget = Budget(args.budget_s * share, *((0, 1) if args.tiny else (3, 20)))
        try:
            with torch.inference_mode():
                results[name] = SECTIONS[name](device, budget, args.tiny)
        except Exception as e:  # record and go on: one broken section must not hide the rest
            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            print(f"[{name}] {results[name]['error']}", flush=True)
        results.setdefault("_seconds", {})[name] = round(time.perf_counter() - t0, 1)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with open(os.path.join(args.out, "sweep_low_precision_gpu.json"), "w") as f:
            json.dump(results, f, indent=2, default=str)
    print_table(results)
    print(f"\nseconds per section: {results['_seconds']}")


if __name__ == "__main__":
    main()
