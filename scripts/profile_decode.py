"""Where a batch-1 decode step's GPU time goes: one step of each target at real size (random bf16
weights; eager, and with CUDA graphs where the profiler sees the replay's kernels), kernel time
summed by category, next to the measured wall time per step.

    python scripts/profile_decode.py OUT_DIR [--steps 8] [--ops] [--only llama]
        [--batch-invariant [on|off|both]] [--batch 1] [--graphs-only] [--quantization fp8]

Llama-3.1-8B and the DeepSeek-V2-Lite shape, 128-token prompt, batch 1; and Llama-3.1-8B's graphed
EAGLE3 verify step (k = 3, simulated mean acceptance length 2.93), whose listing after the LM head
runs through the verification and the draft loop to the next verify. Categories come from the
kernel names (GEMM, attention, norm, RoPE, activation, MoE, copies/casts, other); the table gives
the share of GPU time and microseconds per step, and the JSON keeps the 25 costliest kernels too.
The sum is kernel time only; wall minus kernel time is host time and launch gaps. In the graphs on
Hopper the batch-1 GEMVs start early (programmatic dependent launch, ops/common/pdl.py) and are timed
from then, so kernel times overlap and their sum can exceed the wall time. Each target's JSON
also keeps one step's whole device timeline (LM head to LM head) and where in it the device sat
idle (`step_idle`: graph boundaries and copies show up there). --ops adds, for
each eager profile, the torch ops with their input shapes by device time (which call a kernel
belongs to), into OUT_DIR/profile_ops.txt.

--batch-invariant profiles with ModelConfig.batch_invariant on (issue 23: its cost against the
default path); `--batch-invariant both` profiles each target with the mode off and on in one process
and prints, per category and per kernel, the microseconds per step the mode adds. --batch N decodes
N requests together (the cost is also measured at batch 64). The mode's cost check:

    python scripts/profile_decode.py OUT_DIR --only llama --graphs-only --batch-invariant both [--batch 64]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections import defaultdict

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from foretell import LLM, SamplingParams  # noqa: E402
from foretell.bench.kernels.run import provenance  # noqa: E402

CONFIGS = os.path.join(ROOT, "foretell", "configs")
# First match wins; names are lower-cased kernel names.
CATEGORIES = [
    ("moe", ("moe", "expert", "align", "gate_up_gemv", "down_combine", "router")),
    ("attention", ("attention", "attn", "flash", "mla")),
    ("mla projections", ("head_matmul", "rope_heads")),
    ("sampling", ("argmax", "pick_chunk")),
    ("gemm", ("gemm", "gemv", "cutlass", "sm90_xmma", "cublas", "matmul", "splitk", "small_m", "nvjet",
              "_mma_kernel", "linear")),
    ("norm", ("norm",)),
    ("rope", ("rope", "rotary")),
    ("activation", ("silu", "act_and_mul", "gelu")),
    ("kv write", ("write_kv", "kv_write", "latent")),
    ("copy / cast", ("copy", "cast", "fill", "elementwise", "index", "gather", "cat")),
]


def category(name: str) -> str:
    lowered = name.lower()
    for label, keys in CATEGORIES:
        if any(k in lowered for k in keys):
            return label
    return "other"


def summarize(events, steps: int) -> dict:
    """events: (name, device microseconds) of every kernel -> per-category totals per step."""
    by_category: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, float] = defaultdict(float)
    for name, us in events:
        by_category[category(name)] += us / steps
        by_kernel[name] += us / steps
    total = sum(by_category.values())
    rows = sorted(by_category.items(), key=lambda kv: -kv[1])
    return {
        "total_us_per_step": total,
        "categories": [{"category": c, "us_per_step": us, "share": us / total if total else 0.0} for c, us in rows],
        "top_kernels": [{"kernel": k, "us_per_step": us}
                        for k, us in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:25]],
    }


def kernel_events(prof) -> list[tuple[str, float]]:
    """(kernel name, microseconds) of every device-side event of the profile."""
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def _device_ops_after_lm_heads(prof) -> tuple[list, list[int]]:
    """(every device operation of the profile by start time, the indices of the steps' LM heads:
    the operations within 80% of the longest one's length)."""
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    if len(events) < 3:
        return events, []
    longest = max(e.time_range.elapsed_us() for e in events)
    return events, [i for i, e in enumerate(events) if e.time_range.elapsed_us() > 0.8 * longest]


def _listing(events, head: int, stop: int, width: int) -> list[dict]:
    """Operations head + 1 .. stop - 1: name, start (us after the LM head `head` ended), length."""
    end = events[head].time_range.end
    return [{"op": e.name[:width], "start_us": round(e.time_range.start - end, 2),
             "us": round(e.time_range.elapsed_us(), 2)} for e in events[head + 1:stop]]


def one_step_timeline(prof) -> list[dict]:
    """Every device operation from the end of one step's LM head to the end of the next one's."""
    events, heads = _device_ops_after_lm_heads(prof)
    if len(heads) < 3:
        return []
    first, second = heads[len(heads) // 2 - 1], heads[len(heads) // 2]
    return _listing(events, first, second + 1, 100)


def idle_gaps(timeline: list[dict], most: int = 12) -> dict:
    """Where the device sits idle within a step's timeline (one_step_timeline's rows): the time
    between the end of everything started so far and the next operation's start, in all and the
    longest gaps with the operations around them (graph boundaries and copies show up here; time
    inside short kernels does not)."""
    busy_until, last, gaps = None, None, []
    for row in timeline:
        start, end = row["start_us"], row["start_us"] + row["us"]
        if busy_until is not None and start > busy_until:
            gaps.append({"us": round(start - busy_until, 2), "after": last["op"][:40], "before": row["op"][:40],
                         "at_us": round(busy_until, 2)})
        if busy_until is None or end > busy_until:
            busy_until, last = end, row
    longest = sorted(gaps, key=lambda g: -g["us"])[:most]
    return {"idle_us": round(sum(g["us"] for g in gaps), 2), "gaps": len(gaps), "longest": longest}


def between_steps(prof, after: int = 16) -> list[dict]:
    """The device's work from the end of one step's LM head to the next step's graph (its first
    `after` operations). The time a step takes beyond its graph's kernels goes here (copies,
    sampling, launch latency)."""
    events, heads = _device_ops_after_lm_heads(prof)
    if not heads:
        return []
    i = heads[len(heads) // 2]  # a step in the middle of the profile
    return _listing(events, i, i + 1 + after, 80)


def profile_target(folder: str, steps: int, enforce_eager: bool, ops: list[str] | None = None,
                   spec: dict | None = None, batch_invariant: bool = False, batch: int = 1,
                   quantization: str | None = None) -> dict:
    """Kernel time by category of `steps` decode steps (verify steps with `spec`) of `batch`
    requests, and their wall time per step measured without the profiler (with graphs: the
    replay, so wall minus kernels is the launch gaps)."""
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(folder, dtype="bfloat16", device="cuda", load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=enforce_eager, max_num_seqs=batch, kv_cache_memory_bytes=4 << 30,
              speculative_config=spec, batch_invariant=batch_invariant, quantization=quantization)
    engine = llm.engine
    for i in range(batch):
        prompt = {"prompt_token_ids": [(7 * j + i) % 1000 + 1 for j in range(128)]}
        engine.add_request(f"p{i}", prompt,
                           SamplingParams(temperature=0, max_tokens=12 * steps + 32, ignore_eos=True))
    for _ in range(64):  # prefill (in chunks where the scheduler cuts them), until every request decodes
        engine.step()
        scheduler = engine.scheduler
        if not scheduler.waiting and all(s.num_output_tokens > 0 for s in scheduler.running):
            break
    for _ in range(3):  # first decode steps (allocator, lazy init, Triton compiles)
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - start) * 1e6 / steps
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if ops is not None else [])
    with profile(activities=activities, record_shapes=ops is not None) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    for i in range(batch):
        engine.abort_request(f"p{i}")
    if ops is not None:
        averages = prof.key_averages(group_by_input_shape=True)
        ops.append(averages.table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=40,
                                  max_shapes_column_width=90))
    result = dict(summarize(kernel_events(prof), steps), wall_us_per_step=wall_us, enforce_eager=enforce_eager,
                  batch_invariant=batch_invariant, batch=batch)
    # A verify step runs the draft loop (three draft steps of about a dozen launches) after its LM head.
    result["between_steps"] = between_steps(prof, after=16 if spec is None else 60)
    result["step_timeline"] = one_step_timeline(prof)
    result["step_idle"] = idle_gaps(result["step_timeline"])
    del llm, engine
    torch.cuda.empty_cache()
    return result


def print_table(name: str, result: dict) -> None:
    print(f"\n{name}: {result['total_us_per_step']:.0f} us of kernels per decode step, "
          f"{result['wall_us_per_step']:.0f} us wall")
    for row in result["categories"]:
        print(f"  {row['category']:12} {row['us_per_step']:8.1f} us  {100 * row['share']:5.1f}%")
    for row in result["top_kernels"][:14]:
        print(f"    {row['us_per_step']:8.1f} us  {row['kernel'][:90]}")
    print("  after the LM head (start us, length us):")
    for row in result.get("between_steps", []):
        print(f"    {row['start_us']:8.2f} {row['us']:7.2f}  {row['op']}")
    idle = result.get("step_idle")
    if idle and result.get("step_timeline"):
        print(f"  device idle in one step: {idle['idle_us']:.1f} us in {idle['gaps']} gaps; the longest:")
        for gap in idle["longest"][:6]:
            print(f"    {gap['us']:6.2f} us at {gap['at_us']:8.2f}: {gap['after']} -> {gap['before']}")


def mode_difference(default: dict, invariant: dict) -> dict:
    """What the batch-invariant mode adds to a step (us per step, on minus off): wall, kernels, each
    category, and the kernels by name (among each profile's 25 costliest; one absent from a
    profile's list counts as 0 there)."""
    def by(rows: list[dict], key: str) -> dict[str, float]:
        return {row[key]: row["us_per_step"] for row in rows}

    def diff(off: dict[str, float], on: dict[str, float]) -> list[dict]:
        names = sorted(set(off) | set(on), key=lambda n: -abs(on.get(n, 0.0) - off.get(n, 0.0)))
        return [{"name": n, "off_us": round(off.get(n, 0.0), 1), "on_us": round(on.get(n, 0.0), 1),
                 "added_us": round(on.get(n, 0.0) - off.get(n, 0.0), 1)} for n in names]

    return {
        "wall_us": round(invariant["wall_us_per_step"] - default["wall_us_per_step"], 1),
        "kernel_us": round(invariant["total_us_per_step"] - default["total_us_per_step"], 1),
        "wall_cost": 1 - default["wall_us_per_step"] / invariant["wall_us_per_step"],
        "categories": diff(by(default["categories"], "category"), by(invariant["categories"], "category")),
        "kernels": diff(by(default["top_kernels"], "kernel"), by(invariant["top_kernels"], "kernel"))[:16],
    }


def print_difference(name: str, diff: dict) -> None:
    print(f"\n{name}: the mode adds {diff['wall_us']:.1f} us wall per step ({100 * diff['wall_cost']:.1f}% "
          f"of tok/s), {diff['kernel_us']:.1f} us of kernels")
    for row in diff["categories"]:
        print(f"  {row['name']:12} {row['off_us']:8.1f} -> {row['on_us']:8.1f} us  ({row['added_us']:+.1f})")
    for row in diff["kernels"][:12]:
        print(f"    {row['off_us']:8.1f} -> {row['on_us']:8.1f} us  ({row['added_us']:+.1f})  {row['name'][:80]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ops", action="store_true", help="also torch ops with shapes (eager profiles)")
    parser.add_argument("--only", help="profile only targets whose name contains this (llama, deepseek)")
    parser.add_argument("--batch-invariant", nargs="?", const="on", default="off", choices=("off", "on", "both"),
                        help="profile with ModelConfig.batch_invariant on (or both: off and on, and what it adds)")
    parser.add_argument("--batch", type=int, default=1, help="requests decoded together (default 1)")
    parser.add_argument("--graphs-only", action="store_true", help="skip the eager profiles (fewer engines)")
    parser.add_argument("--quantization", choices=("fp8",), default=None,
                        help="the targets' linears in FP8 (128x128 block scales), as LLM(quantization=...)")
    args = parser.parse_args()
    if args.batch < 1:
        parser.error(f"--batch must be at least 1, got {args.batch}")
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.batch_invariant]
    os.makedirs(args.out_dir, exist_ok=True)
    if not torch.cuda.is_available():
        sys.exit("profile_decode.py needs a CUDA device")
    results = {}
    eagle3 = {"method": "eagle3", "model": f"{CONFIGS}/llama-3.1-8b-eagle3", "num_speculative_tokens": 3,
              "simulate_acceptance": {"mean_acceptance_length": 2.93}}
    targets = (("llama-3.1-8b", f"{CONFIGS}/llama-3.1-8b", None),
               ("deepseek-v2-lite", f"{CONFIGS}/deepseek-v2-lite", None),
               ("llama-3.1-8b eagle3", f"{CONFIGS}/llama-3.1-8b", eagle3))
    for (model, folder, spec), eager, invariant in itertools.product(targets, (True, False), modes):
        if (args.only and args.only not in model) or ((spec is not None or args.graphs_only) and eager):
            continue  # speculation: the graphed verify step only
        name = (f"{model} {'eager' if eager else 'graphs'}" + (f" batch {args.batch}" if args.batch > 1 else "")
                + (f" {args.quantization}" if args.quantization else "")
                + (" batch-invariant" if invariant else ""))
        ops = [] if args.ops and eager else None
        try:
            results[name] = profile_target(folder, args.steps, eager, ops, spec, invariant, args.batch,
                                           args.quantization)
            if ops:
                with open(os.path.join(args.out_dir, "profile_ops.txt"), "a") as f:
                    f.write(f"== {name}\n{ops[0]}\n")
            print_table(name, results[name])
        except Exception as e:  # one target failing must not hide the other
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"\n{name}: {results[name]['error']}")
    if args.batch_invariant == "both":
        for name in [n for n in results if n.endswith(" batch-invariant")]:
            default = results.get(name[: -len(" batch-invariant")], {})
            if "error" not in default and "error" not in results[name]:
                results[name]["added_by_the_mode"] = mode_difference(default, results[name])
                print_difference(name, results[name]["added_by_the_mode"])
    path = os.path.join(args.out_dir, "profile_decode.json")
    with open(path, "w") as f:
        json.dump({"benchmark": "profile_decode", **provenance(torch.device("cuda")), "steps": args.steps,
                   "targets": results}, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
