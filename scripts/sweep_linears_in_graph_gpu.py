"""Judge one-row linear kernels where they run: a whole decode step's linears in ONE CUDA graph (issues 25, 23).

    python scripts/sweep_linears_in_graph_gpu.py [--out DIR] [--families fp8 bf16 batch_invariant]
        [--moe-int4] [--config foretell/configs/llama-3.1-8b] [--budget-s 190] [--max-candidates N]
        [--kinds qkv o gate_up down lm_head] [--batch-invariant-rows 1 4 64] [--batch-invariant-reorder]
    python scripts/sweep_linears_in_graph_gpu.py --tiny        # CPU smoke test: torch twins, no graph

For a model shape (a Hugging Face config.json; Llama-3.1-8B by default) it builds random weights for
every layer (FP8: ~7 GB, so each linear streams its weights from HBM as in decoding), chains the
linears with true data dependencies (x -> qkv -> a [1, q] view -> o -> gate_up gated -> down -> the
next layer ... -> LM head; foretell/bench/kernels/linear_chain.py), captures the chain in one CUDA
graph per candidate (the kernels launch with PDL on Hopper, as the engine's) and replays it. Rows:
  baseline        every kind at the engine's default config (first row; again at the end: drift);
  omitted         the chain with one kind left out: that kind's marginal cost in the graph, per call,
                  and its share of 4.8 TB/s;
  candidate       one kind's config swapped in, the rest at their defaults: the chain's time, the
                  change per call against the baseline, and the kind's estimated in-graph time.
Families (foretell/bench/kernels/linear_kinds.py): "fp8" (triton_fp8_few_rows at one row, 128x128
block scales; the LM head stays bf16 as in quantization="fp8"), "bf16" (triton_gemv), and
"batch_invariant" (ops/gemm/triton_batch_invariant at M = 1, then 4 and 64 for reference, next to
the engine's default path at the same M). For batch_invariant the candidates keep the mode's
reduction order: BLOCK_K and SPLIT stay pick_shape_config's (fixed by (N, K)); only num_stages and,
above 16 rows, the row tile fixed_block_m vary, and each candidate must match the default launch
bitwise. --batch-invariant-reorder adds other shape configs: BLOCK_N 32, 16 and 128 rows of W a
program first, then other (BLOCK_K, SPLIT) pairs (other bits, still invariant if adopted per (N, K)
for every M).
--moe-int4 adds the int4 MoE GEMV at Kimi-K2.5's experts (H 7168, I 2048, 8 of 384, one token)
over 16 MoE layers of distinct experts, as % of 4.8 TB/s (foretell/bench/kernels/moe_int4_chain.py).

Every candidate is checked against its torch twin on layer 0 first (a failing config is recorded
and skipped). --budget-s bounds the sections (shared by SHARES; leftover time moves on); once a
section's time is spent its remaining candidates are recorded as skipped. JSON
(sweep_linears_in_graph.json in --out, default $OUT or .) is rewritten after every row, so a
timeout keeps what was measured. The default run fits in 240 s on the H200.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from foretell.bench.kernels import linear_chain, moe_int4_chain  # noqa: E402
from foretell.bench.kernels.linear_kinds import LAYER_KINDS, LINEAR_FAMILIES  # noqa: E402
from foretell.bench.kernels.run import provenance  # noqa: E402

DEFAULT_CONFIG = os.path.join(ROOT, "foretell", "configs", "llama-3.1-8b")
SHARES = {"fp8": 0.4, "bf16": 0.25, "batch_invariant": 0.35, "moe_int4": 0.25}
# A batch-invariant section's time over its row counts: M = 1 is the one that matters.
BI_ROW_SHARES = {1: 0.5, 4: 0.25, 64: 0.25}
JSON_NAME = "sweep_linears_in_graph.json"


class Results:
    """The rows so far, rewritten to JSON after each one."""

    def __init__(self, path: str, header: dict):
        self.path, self.header, self.rows = path, header, []

    def record(self, row: dict) -> None:
        self.rows.append(row)
        self.write()

    def write(self) -> None:
        with open(self.path, "w") as f:
            json.dump({**self.header, "rows": self.rows}, f, indent=1, default=str)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help=f"folder for {JSON_NAME}")
    parser.add_argument("--families", nargs="*", default=list(LINEAR_FAMILIES), choices=list(LINEAR_FAMILIES),
                        help="linear families to sweep, in this order (none: only --moe-int4)")
    parser.add_argument("--moe-int4", action="store_true", help="also the int4 MoE GEMV at Kimi-K2.5's experts")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="Hugging Face config.json (or its folder)")
    parser.add_argument("--num-layers", type=int, default=None, help="layers in the chain (default: the config's)")
    parser.add_argument("--budget-s", type=float, default=190.0, help="seconds for all sections together")
    parser.add_argument("--max-candidates", type=int, default=None, help="cap per layer kind (besides the default)")
    parser.add_argument("--kinds", nargs="+", default=list(LAYER_KINDS), choices=list(LAYER_KINDS),
                        help="layer kinds whose candidates are swept")
    parser.add_argument("--iters", type=int, default=30, help="timed graph replays per row")
    parser.add_argument("--batch-invariant-rows", type=int, nargs="+", default=list(BI_ROW_SHARES),
                        help="rows M of the batch-invariant chains")
    parser.add_argument("--batch-invariant-reorder", action="store_true",
                        help="batch_invariant: also (BLOCK_N, BLOCK_K, SPLIT) configs other than the mode's")
    parser.add_argument("--no-omit", action="store_true", help="skip the chains with one kind left out")
    parser.add_argument("--tiny", action="store_true", help="toy shapes, torch twins on the CPU, no graph: smoke test")
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    if args.max_candidates is not None and args.max_candidates < 0:
        parser.error(f"--max-candidates must be 0 or more, got {args.max_candidates}")
    if not args.families and not args.moe_int4:
        parser.error("nothing to run: give --families or --moe-int4")
    if args.iters < 1:
        parser.error(f"--iters must be at least 1, got {args.iters}")
    if any(m < 1 for m in args.batch_invariant_rows):
        parser.error(f"--batch-invariant-rows must be positive, got {args.batch_invariant_rows}")
    return args


def run_sections(args: argparse.Namespace, results: Results) -> None:
    use_kernels = not args.tiny
    device = torch.device("cuda" if use_kernels else "cpu")
    dtype = torch.bfloat16 if use_kernels else torch.float32  # (the CPU's bf16 matmuls are slow)
    shapes = (linear_chain.TINY_SHAPES if args.tiny
              else linear_chain.ChainShapes.from_hf_config(args.config, args.num_layers))
    sections = list(args.families) + (["moe_int4"] if args.moe_int4 else [])
    end_of_budget = time.perf_counter() + args.budget_s
    bf16_weights = None

    def settings_until(deadline: float, kinds=tuple(args.kinds), omit=not args.no_omit):
        return linear_chain.SweepSettings(warmup=3 if use_kernels else 0, iters=args.iters if use_kernels else 1,
                                          deadline=deadline, max_candidates=args.max_candidates, kinds=kinds,
                                          omit_rows=omit)

    for i, name in enumerate(sections):
        t0 = time.perf_counter()
        left = sections[i:]
        deadline = t0 + max(0.0, end_of_budget - t0) * SHARES[name] / sum(SHARES[s] for s in left)
        print(f"== {name}: until +{deadline - t0:.0f} s", flush=True)
        try:
            if name == "moe_int4":
                moe_shapes = moe_int4_chain.TINY_MOE if args.tiny else moe_int4_chain.KIMI_K25
                layers = moe_int4_chain.build_layers(moe_shapes, device)
                moe_int4_chain.sweep_moe_int4(layers, moe_shapes, device, use_kernels, settings_until(deadline),
                                              results.record)
                del layers
            elif name == "fp8":
                family = LINEAR_FAMILIES["fp8"](dtype, device, use_kernels)
                weights = linear_chain.build_weights(family, shapes)
                linear_chain.sweep_family(family, weights, shapes, 1, settings_until(deadline), results.record,
                                          "fp8 M=1")
                del weights
            else:
                bf16 = LINEAR_FAMILIES["bf16"](dtype, device, use_kernels)
                if bf16_weights is None:  # the bf16 and batch-invariant sections share them
                    bf16_weights = linear_chain.build_weights(bf16, shapes)
                if name == "bf16":
                    linear_chain.sweep_family(bf16, bf16_weights, shapes, 1, settings_until(deadline),
                                              results.record, "bf16 M=1")
                else:
                    invariant = LINEAR_FAMILIES["batch_invariant"](dtype, device, use_kernels,
                                                                   reorder=args.batch_invariant_reorder)
                    rows = args.batch_invariant_rows
                    for j, m in enumerate(rows):
                        start = time.perf_counter()
                        shares = [BI_ROW_SHARES.get(r, 0.25) for r in rows[j:]]
                        sub = start + max(0.0, deadline - start) * shares[0] / sum(shares)
                        # The engine's default path at the same M (GEMV / MMA / cuBLAS): the mode's cost.
                        linear_chain.sweep_family(bf16, bf16_weights, shapes, m, settings_until(sub, (), False),
                                                  results.record, f"default path M={m}")
                        linear_chain.sweep_family(invariant, bf16_weights, shapes, m, settings_until(sub),
                                                  results.record, f"batch_invariant M={m}")
            if name in ("bf16", "batch_invariant") and not {"bf16", "batch_invariant"} & set(sections[i + 1:]):
                bf16_weights = None
        except Exception as e:  # noqa: BLE001  (record and go on: one broken section must not hide the rest)
            results.record({"section": name, "variant": "section error", "ok": False,
                            "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]})
            print(f"[{name}] {type(e).__name__}: {e}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        results.header.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
        results.write()


def print_table(rows: list[dict], top: int = 6) -> None:
    """Per section: the baselines, the omitted kinds, and per kind the default then the fastest candidates."""
    sections = list(dict.fromkeys(r["section"] for r in rows))
    print(f"\n{'section':<22} {'kind':<8} {'config':<52} {'chain us':>9} {'d/call us':>9} {'kind us':>8} "
          f"{'of 4.8TB/s':>10}")
    for section in sections:
        mine = [r for r in rows if r["section"] == section]
        for r in mine:
            if r["variant"] in ("baseline", "baseline (end)", "omitted", "section error", "default check"):
                _print_row(section, r)
        for kind in dict.fromkeys([*LAYER_KINDS, *moe_int4_chain.MOE_KERNELS, "both"]):
            timed = sorted((r for r in mine if r["variant"] == "candidate" and r.get("layer_kind") == kind
                            and r.get("ok")), key=lambda r: r["chain_us"])
            failed = sum(1 for r in mine if r["variant"] == "candidate" and r.get("layer_kind") == kind
                         and not r.get("ok"))
            for r in timed[:top]:
                _print_row(section, r)
            if failed:
                print(f"{section:<22} {kind:<8} ({failed} candidates failed or skipped: see the JSON)")


def _print_row(section: str, r: dict) -> None:
    def number(key: str, width: int, digits: int = 2) -> str:
        return f"{r[key]:{width}.{digits}f}" if isinstance(r.get(key), (int, float)) else " " * width

    if not r.get("ok"):
        print(f"{section:<22} {r.get('layer_kind', ''):<8} {str(r.get('config', ''))[:52]:<52} "
              f"{str(r.get('error') or r.get('skipped'))[:60]}")
        return
    kind_us = "kind_us_marginal" if r["variant"] == "omitted" else "kind_us_est"
    share = f"{r['fraction_of_bandwidth']:10.1%}" if isinstance(r.get("fraction_of_bandwidth"), float) else ""
    label = r["config"] if r["variant"] == "candidate" else f"[{r['variant']}] {r['config']}"
    print(f"{section:<22} {r.get('layer_kind', ''):<8} {label[:52]:<52} {number('chain_us', 9)} "
          f"{number('delta_per_call_us', 9, 3)} {number(kind_us, 8)} {share}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("sweep_linears_in_graph_gpu.py needs a CUDA GPU (or --tiny for a smoke test)")
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda" if not args.tiny else "cpu")
    header = {"provenance": provenance(device), "args": vars(args)}
    if not args.tiny:
        from foretell.ops.common.pdl import pdl_enabled

        header["pdl"] = pdl_enabled(torch.empty(1, device=device))
    results = Results(os.path.join(args.out, JSON_NAME), header)
    with torch.inference_mode():
        run_sections(args, results)
    print_table(results.rows)
    print(f"\nseconds per section: {results.header.get('seconds')}; JSON: {results.path}")


if __name__ == "__main__":
    main()
