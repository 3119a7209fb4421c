"""Suffix decoding against plain decoding with both engines in one process, alternating (issue 29).

`foretell bench --methods suffix` runs plain first and suffix after it: on the H200 a tiny target's
plain steps are bound by the host, whose speed drifts within a call and differs 2x between lent
machines, so one ordered pair of runs misleads. Here both engines (the default family's target;
suffix at k drafts, gate "auto") are built first, warmed on one prompt set, then each repeat gives
both the same fresh set of GSM8K test prompts (the suffix engine's cross-request cache never holds
a re-asked prompt's answer), plain first then suffix, and prints tok/s and the gate's learned step
costs (get_stats()["suffix_gate"]).

    python scripts/suffix_side_by_side.py [--device cuda] [--repeats 3] [--k 3] [--num-prompts 16]
        [--max-tokens 128] [--output-json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from foretell import LLM, SamplingParams  # noqa: E402
from foretell.bench.datasets import load_prompts  # noqa: E402
from foretell.defaults import default_target  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.repeats < 1 or args.num_prompts < 1:
        parser.error("--repeats and --num-prompts must be >= 1")
    n = args.num_prompts
    prompts = [p.text if p.text is not None else {"prompt_token_ids": p.token_ids}
               for p in load_prompts("gsm8k", n * (args.repeats + 1))]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    memory = {"kv_cache_memory_bytes": 2 << 30}  # two engines share the device
    specs = {"none": None, "suffix": {"method": "suffix", "num_speculative_tokens": args.k}}
    engines = {name: LLM(default_target("qwen3"), speculative_config=spec, device=args.device, max_num_seqs=1,
                         log_stats_interval_s=0, **memory) for name, spec in specs.items()}
    for llm in engines.values():
        llm.generate(prompts[:n], params, use_tqdm=False)  # the warm-up set
    rows = []
    for rep in range(args.repeats):
        batch = prompts[n * (rep + 1): n * (rep + 2)]
        for name, llm in engines.items():
            start = time.perf_counter()
            outputs = llm.generate(batch, params, use_tqdm=False)
            wall = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            rows.append({"repeat": rep, "method": name, "tok_s": round(tokens / wall, 1),
                         "gate": llm.get_stats().get("suffix_gate")})
        plain, suffix = rows[-2]["tok_s"], rows[-1]["tok_s"]
        print(f"repeat {rep}: plain {plain:.1f} tok/s, suffix {suffix:.1f} ({suffix / plain:.2f}x); "
              f"gate {json.dumps(rows[-1]['gate'])}", flush=True)
    for llm in engines.values():
        llm.close()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
