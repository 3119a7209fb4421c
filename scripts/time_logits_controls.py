"""Step time with logits controls on the CPU: the padded device step (runner/padded_logits_controls.py)
against the host step they used to take, with a no-op logit_bias ({token: 0.0}: processed, changes
nothing, so all three runs make the same tokens).

Runs the default Qwen3-layout family greedy in float32 on the CPU: EAGLE3 (target + head, k = 3)
and plain decoding queued ahead (no drafter, async scheduling on), each (a) without controls, (b)
with the no-op bias on the padded step, (c) with it forced onto the host step (the rule before:
any request with logits processing took the host step). Times every ModelRunner.execute (wall
and CPU seconds; CPU seconds move less with the machine's load) and the whole generate.

  python scripts/time_logits_controls.py --num-prompts 1 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from foretell import LLM, SamplingParams
from foretell.bench.datasets import gsm8k_test_prompts
from foretell.runner import decode_ahead, graphed_verify
from foretell.runner.model_runner import ModelRunner

DEFAULTS = os.path.join(os.path.dirname(__file__), "..", "foretell", "default_models")


def host_only(params) -> bool:
    """The rule before the padded controls: any logits processing takes the host step."""
    return params.structured_outputs is None and not params.needs_logits_processing


def time_run(args, drafter: str, mode: str, prompts: list[str]) -> dict:
    spec = None
    if drafter == "eagle3":
        spec = {"method": "eagle3", "model": args.head, "num_speculative_tokens": 3}
    llm = LLM(args.target, speculative_config=spec, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 28,
              max_num_seqs=max(len(prompts), 1), async_scheduling="on" if drafter == "plain" else "off",
              warm_up="off")
    bias = None if mode == "none" else {7: 0.0}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logit_bias=bias)
    saved = graphed_verify.padded_step_takes, decode_ahead.padded_step_takes
    if mode == "host":
        graphed_verify.padded_step_takes = decode_ahead.padded_step_takes = host_only
    execute = ModelRunner.execute
    calls, wall, cpu = [0], [0.0], [0.0]

    def timed(self, sched):
        w, c = time.perf_counter(), time.process_time()
        try:
            return execute(self, sched)
        finally:
            calls[0] += 1
            wall[0] += time.perf_counter() - w
            cpu[0] += time.process_time() - c

    try:
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, logit_bias=bias), use_tqdm=False)
        ModelRunner.execute = timed
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        ModelRunner.execute = execute
        graphed_verify.padded_step_takes, decode_ahead.padded_step_takes = saved
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    n = max(calls[0], 1)
    return {"drafter": drafter, "controls": mode, "prompts": len(prompts), "tok_s": tokens / seconds,
            "steps": calls[0], "step_wall_ms": 1e3 * wall[0] / n, "step_cpu_ms": 1e3 * cpu[0] / n,
            "tokens": [o.outputs[0].token_ids for o in outputs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=os.path.join(DEFAULTS, "qwen3-target"))
    parser.add_argument("--head", default=os.path.join(DEFAULTS, "qwen3-eagle3"))
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[1, 4], help="batch sizes")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-cpu-threads", type=int, default=1)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    torch.set_num_threads(args.num_cpu_threads)
    rows = []
    for batch in args.num_prompts:
        prompts = gsm8k_test_prompts(batch)
        for drafter in ("eagle3", "plain"):
            runs = [time_run(args, drafter, mode, prompts) for mode in ("none", "padded", "host")]
            if len({json.dumps(r["tokens"]) for r in runs}) != 1:
                raise SystemExit(f"{drafter} batch {batch}: the three runs made different tokens")
            for r in runs:
                r.pop("tokens")
                print(json.dumps(r), flush=True)
            rows.extend(runs)
    print(f"\n{args.max_tokens} tokens per GSM8K prompt, greedy, float32, CPU, {args.num_cpu_threads} thread(s), "
          f"load average {os.getloadavg()[0]:.2f} (the same tokens in every run)\n")
    print("| drafter | batch | logit_bias | step | steps | step wall ms | step CPU ms | tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        bias = "none" if r["controls"] == "none" else "{7: 0.0}"
        step = "host" if r["controls"] == "host" else "padded"
        print(f"| {r['drafter']} | {r['prompts']} | {bias} | {step} | {r['steps']} | {r['step_wall_ms']:.1f} | "
              f"{r['step_cpu_ms']:.1f} | {r['tok_s']:.1f} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
