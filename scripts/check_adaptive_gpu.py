"""Issue 28's adaptive-speculation bar on the GPU: at every batch size, adaptive speculation
(num_speculative_tokens "auto", K = 4) is never more than 3% slower than the better of fixed-k
EAGLE3 (k = 1..4) and no speculation.

    python scripts/check_adaptive_gpu.py OUT_DIR [--lengths 2.93,1.5] [--batches 1,4,16,64,256]
        [--ks 1,2,3,4] [--new-tokens 256] [--repeats 3] [--tiny]

Llama-3.1-8B shape with its EAGLE3 head (foretell/configs, bf16, random weights, CUDA graphs),
acceptance simulated: for a mean acceptance length L the conditional rate a with 1 + a + a^2 + a^3
= L (simulated_acceptance.py's fit at k = 3), the same per-position rates a^j for every k (fixed
k takes the first k; adaptive all 4), so every configuration meets the same acceptance. Each
configuration is one engine (start-up reported as start_s; adaptive seeds its step costs from
timed replays of its CUDA graphs at start-up, runner/startup_costs.py, reported as
prior_timing_s, and learns from its own steps, the warm-up runs' included); each batch size one
closed-loop run of `batch` requests of 128-token prompts and --new-tokens tokens (EOS ignored;
256 by default, ~90 steps at 2.93: a few exploring steps at the start are not the whole run),
after a warm-up run of the same shape; tok/s is generated tokens over the run's wall time, the
median of --repeats timed runs (a single 0.3-s run differed by a few percent between engines of
the same work). Each row also has ms per engine step and, for auto, the share of steps an
exploration held and the steps it chose another k than the best fixed configuration's (none
counts as k = 0): a gap with auto's ms/step above the best fixed k's while choosing that k is
per-step overhead, not the choice. Writes
OUT_DIR/check_adaptive_gpu.json after every engine (a partial result survives a time-out), prints
a table per length: tok/s of none, each k, auto, the ratio of auto to the best of the others and
the bar (>= 0.97), and the k auto chose.

--tiny runs the same flow on a tiny random Qwen3 + EAGLE3 head (the CPU works: a smoke test).
Budget on the H200: about 8 engines per length (each loads dummy 8B weights and captures graphs up
to max_num_seqs = the largest batch); split --lengths / --batches over calls when time is short.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from foretell import LLM, SamplingParams  # noqa: E402
from foretell.bench.bench_models import eagle3_bench_models  # noqa: E402
from foretell.spec_decode.simulated_acceptance import rates_from_config  # noqa: E402

MAX_K = 4
BAR = 0.97


def conditional_rate(mean_length: float) -> float:
    """The constant conditional acceptance a of a chain of 3 with that mean acceptance length."""
    return rates_from_config({"mean_acceptance_length": mean_length}, 3)[0]


def spec_config(head: str, k: int | str, rate: float) -> dict | None:
    if k == 0:
        return None
    drafts = MAX_K if k == "auto" else k
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k,
            "simulate_acceptance": {"rates": [rate ** j for j in range(1, drafts + 1)]}}


def run_batch(llm: LLM, batch: int, new_tokens: int, repeats: int = 1) -> dict:
    """A warm-up run, then `repeats` timed runs of the same shape: tok/s is the median run's (each
    run's tok/s kept in runs_tok_s, so the spread between runs shows beside the gaps between
    configurations); the counters cover all the timed runs."""
    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 1 for j in range(128)]} for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # every shape of the run compiled / captured
    before = llm.get_stats()
    runs, walls = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - start)
        runs.append(sum(len(o.outputs[0].token_ids) for o in outs) / walls[-1])
    after = llm.get_stats()
    median = sorted(range(repeats), key=lambda i: runs[i])[(repeats - 1) // 2]
    row = {"batch": batch, "tok_s": runs[median], "wall_s": walls[median], "runs_tok_s": runs}
    steps = after.get("num_steps", 0) - before.get("num_steps", 0)
    if steps:  # per-step time: tells a slower step (overhead) from a worse choice (fewer tokens a step)
        row["num_steps"] = steps / repeats
        row["ms_per_step"] = 1000 * sum(walls) / steps
    launched = after.get("steps_queued_ahead", 0) - before.get("steps_queued_ahead", 0)
    if steps:  # steps whose launch was queued ahead of the step before's results (and used): the rest paid
        # their host work between two device steps
        row["queued_ahead_share"] = (after.get("steps_queued_ahead_used", 0)
                                     - before.get("steps_queued_ahead_used", 0)) / steps
        row["queued_ahead_dropped"] = launched - row["queued_ahead_share"] * steps
    if after.get("num_drafts"):
        drafts = after["num_drafts"] - before.get("num_drafts", 0)
        accepted = after["num_accepted_tokens"] - before.get("num_accepted_tokens", 0)
        row["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
    if "adaptive_chosen_k_histogram" in after:
        hist = [a - b for a, b in zip(after["adaptive_chosen_k_histogram"], before["adaptive_chosen_k_histogram"])]
        row["chosen_k_histogram"] = hist
        row["mean_chosen_k"] = sum(k * n for k, n in enumerate(hist)) / max(sum(hist), 1)
        exploring = after.get("adaptive_exploring_steps", 0) - before.get("adaptive_exploring_steps", 0)
        row["exploring_share"] = exploring / max(sum(hist), 1)
    return row


def steps_off_best(histogram: list[int], best_name: str) -> tuple[int, int]:
    """(steps auto chose another k than the best fixed configuration's, steps): none is k = 0."""
    best_k = 0 if best_name == "none" else int(best_name.split("=")[1])
    total = sum(histogram)
    return total - (histogram[best_k] if best_k < len(histogram) else 0), total


def table(length: float, results: dict, batches: list[int], ks: list) -> str:
    names = ["none"] + [f"k={k}" for k in ks if k != "auto"] + ["auto"]
    lines = [f"mean acceptance length {length} (conditional rate {conditional_rate(length):.3f}), tok/s:",
             "| batch | " + " | ".join(names) + " | auto / best other | bar | auto mean k | auto exploring |"
             " auto steps off the best k | ms/step best other / auto |"]
    for b in batches:
        cells, rates = [], {}
        for name in names:
            row = results.get(name, {}).get(str(b))
            rates[name] = row["tok_s"] if row else None
            cells.append(f"{row['tok_s']:.1f}" if row else "-")
        others = [v for n, v in rates.items() if n != "auto" and v is not None]
        if rates["auto"] is None or not others:
            lines.append(f"| {b} | " + " | ".join(cells) + " | - | - | - | - | - | - |")
            continue
        ratio = rates["auto"] / max(others)
        auto = results["auto"][str(b)]
        best_name = max((n for n in names if n != "auto" and rates[n] is not None), key=lambda n: rates[n])
        best_ms = results[best_name][str(b)].get("ms_per_step", float("nan"))
        off, steps = steps_off_best(auto.get("chosen_k_histogram", []), best_name)
        auto["steps_off_best_k"] = off
        lines.append(f"| {b} | " + " | ".join(cells) + f" | {ratio:.3f} | {'ok' if ratio >= BAR else 'MISS'} | "
                     f"{auto.get('mean_chosen_k', 0.0):.2f} | {100 * auto.get('exploring_share', 0.0):.1f}% | "
                     f"{off} of {steps} ({best_name}) | "
                     f"{best_ms:.2f} / {auto.get('ms_per_step', float('nan')):.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--lengths", default="2.93,1.5", help="simulated mean acceptance lengths")
    parser.add_argument("--batches", default="1,4,16,64,256")
    parser.add_argument("--ks", default="1,2,3,4", help="fixed k to compare against (auto and none always run)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per batch size (the median is kept)")
    parser.add_argument("--tiny", action="store_true", help="tiny random models (CPU smoke test)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    os.makedirs(args.out_dir, exist_ok=True)
    out_path = os.path.join(args.out_dir, "check_adaptive_gpu.json")
    batches = [int(b) for b in args.batches.split(",")]
    ks: list = [int(k) for k in args.ks.split(",")] + ["auto"]
    target, head, options = eagle3_bench_models(args.tiny)
    report: dict = {"batches": batches, "bar": BAR, "lengths": {}}
    for length in [float(x) for x in args.lengths.split(",")]:
        rate = conditional_rate(length)
        results: dict = {}
        report["lengths"][str(length)] = results
        for k in [0] + ks:
            name = "none" if k == 0 else ("auto" if k == "auto" else f"k={k}")
            start = time.perf_counter()
            llm = LLM(target, speculative_config=spec_config(head, k, rate), skip_tokenizer_init=True,
                      max_num_seqs=max(batches), log_stats_interval_s=0, **options)
            results[name] = {"start_s": time.perf_counter() - start}
            for b in batches:
                results[name][str(b)] = run_batch(llm, b, args.new_tokens, args.repeats)
                print(name, results[name][str(b)], flush=True)
            if k == "auto":  # seeded from graph replays at start-up, learned from the runs' own steps
                results[name]["step_costs"] = llm.get_stats()["adaptive_step_costs"]
                results[name]["prior_timing_s"] = results[name]["step_costs"].get("startup_seconds")
            llm.close()
            with open(out_path, "w") as f:
                json.dump(report, f, indent=2)
        print(table(length, results, batches, ks), flush=True)
        if "auto" in results:
            costs = results["auto"]["step_costs"]
            seeded = [b for b, row in zip(costs["batch_sizes"], costs.get("prior_ms", [])) if row[0] is not None]
            print(f"auto: start-up step-cost timing {results['auto']['prior_timing_s']} s, priors at batches "
                  f"{seeded or 'none (no CUDA graphs)'}", flush=True)
        with open(out_path, "w") as f:  # with each row's steps_off_best_k
            json.dump(report, f, indent=2)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
