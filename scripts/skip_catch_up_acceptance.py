"""What skipping the EAGLE3 head's catch-up on k = 0 steps costs in acceptance (issue 28,
speculative_config adaptive_skip_catch_up): the default Qwen3-layout family, real acceptance,
greedy, GSM8K test prompts, float32 on the CPU.

Adaptive speculation's choice is forced per engine step (every sequence of the batch alike):
  - "stretch N": k = 0 for the first N steps (the prefill's included), then k = 3 on every step;
    the drafts after the stretch read the head's KV cache with holes at the N skipped positions;
  - "probe S": one step of k = 3 after every S steps of k = 0 (isolated drafting steps, as
    adaptive speculation's explorations at a batch where k = 0 wins), each reading holes;
    "probe S:W": the same with the skip on only W steps before each probe off (the head caught
    up on the last W positions: what a catch-up window of W deferred positions would give).
For each, with the skip on and off: the mean acceptance length (1 + accepted per verify) of the
first verify after the stretch, of the first 8, and of all verifies after it (probes: of all),
and whether greedy output is the same with the skip on and off.

  python scripts/skip_catch_up_acceptance.py --num-prompts 64 --max-tokens 128 \
      --patterns stretch:16 probe:16 probe:16:4 --output-json skip_acceptance.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from foretell import LLM, SamplingParams
from foretell.bench.datasets import gsm8k_test_prompts
from foretell.spec_decode.adaptive import AdaptiveDraftLength

DEFAULTS = os.path.join(os.path.dirname(__file__), "..", "foretell", "default_models")
K = 3


def forced_choice(pattern: str):
    """(choose(step), catches_up(step)) for a pattern "stretch:N", "probe:S" or "probe:S:W"
    (module docstring): the step's choice, and whether a k = 0 step then still catches up."""
    kind, n, *window = pattern.split(":")
    n, w = int(n), int(window[0]) if window else 0
    if kind == "stretch":
        return (lambda step: 0 if step < n else K), (lambda step: False)
    if kind == "probe":
        return (lambda step: K if step % (n + 1) == n else 0), (lambda step: step % (n + 1) >= n - w)
    raise ValueError(f"unknown pattern {pattern!r}: stretch:N, probe:S or probe:S:W")


def run(llm: LLM, prompts, params, choice, skip: bool) -> tuple[list[list[int]], list[tuple[int, int, int]]]:
    """Outputs and every verify as (step, drafted, accepted), under the forced choices."""
    step = [-1]
    verifies = []
    choose_k, catches_up = choice
    runner = llm.engine.runner

    def choose(self, batch_size):
        step[0] += 1
        runner.draft_graphs.skip_catch_up = runner.host_step.skip_catch_up = skip and not catches_up(step[0])
        return choose_k(step[0])

    def observe(self, drafted, accepted):
        verifies.append((step[0], drafted, accepted))

    saved = AdaptiveDraftLength.choose, AdaptiveDraftLength.observe
    AdaptiveDraftLength.choose, AdaptiveDraftLength.observe = choose, observe
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        AdaptiveDraftLength.choose, AdaptiveDraftLength.observe = saved
    return tokens, verifies


def mean_length(verifies) -> float | None:
    drafted = [(d, a) for _, d, a in verifies if d > 0]
    return 1 + sum(a for _, a in drafted) / len(drafted) if drafted else None


def summary(pattern: str, verifies) -> dict:
    kind, n = pattern.split(":")[:2]
    if kind == "probe":
        return {"all": mean_length(verifies), "verifies": len(verifies)}
    after = [v for v in verifies if v[0] > int(n)]  # drafts chosen at step >= N, verified from N + 1
    first = min((v[0] for v in after), default=None)
    return {"first": mean_length([v for v in after if v[0] == first]),
            "first 8": mean_length([v for v in after if v[0] < (first or 0) + 8]),
            "all": mean_length(after), "verifies": len(after)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=os.path.join(DEFAULTS, "qwen3-target"))
    parser.add_argument("--head", default=os.path.join(DEFAULTS, "qwen3-eagle3"))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--patterns", nargs="+",
                        default=["stretch:0", "stretch:4", "stretch:16", "stretch:48", "probe:4", "probe:16", "probe:48"])
    parser.add_argument("--num-cpu-threads", type=int, default=1)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    torch.set_num_threads(args.num_cpu_threads)
    prompts = gsm8k_test_prompts(args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    engine = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 30, max_num_seqs=256,
                  max_num_batched_tokens=1 << 15, warm_up="off")  # every prompt prefilled in step 0
    llms = {skip: LLM(args.target, **engine, speculative_config={
        "method": "eagle3", "model": args.head, "num_speculative_tokens": K, "adaptive": True,
        "adaptive_skip_catch_up": skip}) for skip in (True, False)}
    rows = {}
    for pattern in args.patterns:
        outputs, row = {}, {}
        for skip, llm in llms.items():
            start = time.perf_counter()
            outputs[skip], verifies = run(llm, prompts, params, forced_choice(pattern), skip)
            row["skip on" if skip else "skip off"] = {**summary(pattern, verifies),
                                                      "seconds": round(time.perf_counter() - start, 1)}
        row["greedy equal prompts"] = sum(a == b for a, b in zip(outputs[True], outputs[False]))
        rows[pattern] = row
        print(f"{pattern}: {json.dumps(row)}", flush=True)
    print(f"\n{len(prompts)} GSM8K test prompts x {args.max_tokens} tokens, greedy, float32, CPU, K = {K}\n")
    print("| pattern | skip | first verify after | first 8 | all after | verifies | greedy on = off |")
    print("|---|---|---|---|---|---|---|")
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    for pattern, row in rows.items():
        for name in ("skip on", "skip off"):
            r = row[name]
            print(f"| {pattern} | {name} | {fmt(r.get('first'))} | {fmt(r.get('first 8'))} | {fmt(r['all'])} | "
                  f"{r['verifies']} | {row['greedy equal prompts']} / {len(prompts)} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"prompts": len(prompts), "max_tokens": args.max_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
