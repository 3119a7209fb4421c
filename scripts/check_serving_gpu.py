"""Issue 32's GPU checks for the default family, in one process:

    python scripts/check_serving_gpu.py OUT_DIR [--lengths 200]

1. compiles: an engine built as `foretell serve` builds it (warm-up on, prefix caching on), then
   prompts of N distinct lengths, twice (the second pass hits the prefix cache and meets other
   prefill shapes): Triton compilations after start-up (goal 0), each named with its kernel and
   constexprs so a miss can be fixed, and the per-request latency (p50 / p99 / max).
2. decode: the default target at batch 1, plain and with EAGLE3 k=3 (tok/s, ms a step).
Writes OUT_DIR/check_serving_gpu.json and prints a short table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from foretell import LLM, SamplingParams  # noqa: E402
from foretell.bench import engine_probe as probe  # noqa: E402
from foretell.bench.datasets import gsm8k_test_prompts  # noqa: E402
from foretell.defaults import member_path  # noqa: E402


class CompileLog:
    """Every Triton compilation from install() on: kernel name and its specialisation."""

    def __init__(self):
        self.events: list[dict] = []

    def install(self) -> None:
        from triton import knobs

        def hook(*args, **kwargs):
            fn = kwargs.get("fn")
            name = getattr(getattr(fn, "fn", fn), "__name__", repr(fn))
            self.events.append({"kernel": name, "key": str(kwargs.get("key")),
                                "constexprs": str(kwargs.get("constexprs"))})
            return False

        knobs.runtime.jit_post_compile_hook = hook


def percentiles(ms: list[float]) -> dict:
    q = sorted(ms)
    pick = lambda f: q[min(len(q) - 1, int(f * len(q)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": q[-1], "n": len(q)}


def compiles_after_warm_up(num_lengths: int, method: str) -> dict:
    spec = None
    if method == "eagle3":
        spec = {"method": "eagle3", "model": member_path("eagle3"), "num_speculative_tokens": 3}
    llm = LLM(member_path("target"), device="cuda", speculative_config=spec, log_stats_interval_s=0,
              kv_cache_memory_bytes=2 << 30)
    log = CompileLog()
    log.install()
    tokenizer = llm.tokenizer
    text = " ".join(gsm8k_test_prompts(400))
    ids = tokenizer.encode(text)
    longest = min(probe.max_model_len(llm) - 16, len(ids))
    lengths = sorted({max(1, round(1 + i * (longest - 1) / max(1, num_lengths - 1))) for i in range(num_lengths)})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    passes = []
    for _ in range(2):
        latencies = []
        for n in lengths:
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids[:n]}], params, use_tqdm=False)
            latencies.append(1000 * (time.perf_counter() - t0))
        passes.append(percentiles(latencies))
    by_kernel: dict[str, int] = {}
    for e in log.events:
        by_kernel[e["kernel"]] = by_kernel.get(e["kernel"], 0) + 1
    stats = llm.get_stats()
    return {"method": method, "num_lengths": len(lengths), "warm_up_s": probe.warm_up_seconds(llm),
            "compiles_after_warm_up": len(log.events), "by_kernel": by_kernel, "events": log.events[:60],
            "engine_jit_compiles": stats.get("jit_compiles"), "latency_ms": passes,
            "prefix_cache_hit_rate": stats.get("prefix_cache_hit_rate")}


def decode_rate(method: str, new_tokens: int = 256) -> dict:
    spec = None
    if method == "eagle3":
        spec = {"method": "eagle3", "model": member_path("eagle3"), "num_speculative_tokens": 3}
    llm = LLM(member_path("target"), device="cuda", speculative_config=spec, log_stats_interval_s=0,
              kv_cache_memory_bytes=2 << 30)
    prompt = gsm8k_test_prompts(1)[0]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    best = None
    for _ in range(3):
        before = llm.get_stats()["num_steps"]
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        seconds = time.perf_counter() - t0
        steps = llm.get_stats()["num_steps"] - before
        row = {"tok_s": len(out.token_ids) / seconds, "ms_per_step": 1000 * seconds / max(1, steps),
               "steps": steps}
        best = row if best is None or row["tok_s"] > best["tok_s"] else best
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--lengths", type=int, default=200)
    p.add_argument("--only", help="comma-separated sections (default: all)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    result: dict = {}
    sections = {"decode_plain": lambda: decode_rate("none"), "decode_eagle3": lambda: decode_rate("eagle3"),
                "compiles_plain": lambda: compiles_after_warm_up(args.lengths, "none"),
                "compiles_eagle3": lambda: compiles_after_warm_up(args.lengths, "eagle3")}
    chosen = args.only.split(",") if args.only else list(sections)
    unknown = set(chosen) - set(sections)
    if unknown:
        p.error(f"--only: unknown sections {sorted(unknown)}; known: {', '.join(sections)}")
    for name, fn in ((name, sections[name]) for name in chosen):
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as e:  # one section failing still leaves the others' numbers
            import traceback

            result[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        result[name]["section_s"] = time.perf_counter() - t0
        gc.collect()  # the section's engine goes with its frame: give its GPU memory back
        torch.cuda.empty_cache()
        with open(os.path.join(args.out, "check_serving_gpu.json"), "w") as f:
            json.dump(result, f, indent=1)
        print(name, json.dumps({k: v for k, v in result[name].items() if k not in ("events", "trace")})[:600],
              flush=True)


if __name__ == "__main__":
    main()
