"""Suffix decoding against plain decoding with both engines in one process, alternating (issue 29).

`foretell bench --methods suffix` runs plain first and suffix after it: on the H200 a tiny target's
plain steps are bound by the host, whose speed drifts within a call and differs 2x between lent
machines, so one ordered pair of runs misleads. Here both engines (the default family's target;
suffix at k drafts, gate "auto") are built first, warmed on one prompt set, then each repeat gives
both the same fresh set of prompts (GSM8K test questions by default; the suffix engine's
cross-request cache never holds a re-asked prompt's answer) and prints tok/s, engine steps and
milliseconds a step (the wall time over the steps: the suffix engine's quiet steps against plain's
show there when it drafts little) and the gate's learned step costs (get_stats()["suffix_gate"]);
at the end each engine's steps by kind over every repeat (bench/step_kinds.py: whether a loss lies in
the drafting, fallback or plain steps).
The two engines take turns request by request, each going first on every other prompt, so a drift of
the host's speed lands on both (--whole-sets: plain's whole set, then suffix's); the last line pools
every repeat's tokens and seconds. --with-null adds a third engine, suffix whose drafter proposes
nothing at once: what the host-drafter engine costs apart from the drafter's own work; --tree TOPK,NODES
one more, suffix drafting trees (speculative_config topk and num_draft_tokens: the tree step).

    python scripts/suffix_side_by_side.py [--device cuda] [--repeats 3] [--k 3] [--num-prompts 16]
        [--max-tokens 128] [--dataset gsm8k] [--ignore-eos] [--min-accepted auto] [--whole-sets] [--with-null]
        [--tree 2,12] [--output-json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from foretell import LLM, SamplingParams  # noqa: E402
from foretell.bench.datasets import load_prompts  # noqa: E402
from foretell.bench.engine_probe import propose_nothing  # noqa: E402
from foretell.bench.step_kinds import StepKinds, format_kinds  # noqa: E402
from foretell.defaults import default_target  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dataset", default="gsm8k", help="a prompt set of foretell bench (gsm8k, repetitive)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--min-accepted", default="auto",
                        help="suffix_decoding_min_accepted_tokens: the gate's bar (auto: learned), or a number")
    parser.add_argument("--whole-sets", action="store_true", help="each engine's whole set in turn")
    parser.add_argument("--with-null", action="store_true",
                        help="a third engine: suffix whose drafter proposes nothing at once (the host-drafter "
                             "engine's own cost, apart from the drafter's)")
    parser.add_argument("--tree", default=None, metavar="TOPK,NODES",
                        help="a further engine: suffix draft trees (speculative_config topk, num_draft_tokens)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.repeats < 1 or args.num_prompts < 1:
        parser.error("--repeats and --num-prompts must be >= 1")
    n = args.num_prompts
    prompts = [p.text if p.text is not None else {"prompt_token_ids": p.token_ids}
               for p in load_prompts(args.dataset, n * (args.repeats + 1))]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    memory = {"kv_cache_memory_bytes": 2 << 30}  # two engines share the device
    bar = args.min_accepted if args.min_accepted == "auto" else float(args.min_accepted)
    specs = {"none": None, "suffix": {"method": "suffix", "num_speculative_tokens": args.k,
                                      "suffix_decoding_min_accepted_tokens": bar}}
    if args.with_null:
        specs["null"] = specs["suffix"]
    if args.tree:
        topk, nodes = (int(v) for v in args.tree.split(","))
        specs["tree"] = {**specs["suffix"], "topk": topk, "num_draft_tokens": nodes}
    engines = {name: LLM(default_target("qwen3"), speculative_config=spec, device=args.device, max_num_seqs=1,
                         log_stats_interval_s=0, **memory) for name, spec in specs.items()}
    if args.with_null:
        propose_nothing(engines["null"])
    for llm in engines.values():
        llm.generate(prompts[:n], params, use_tqdm=False)  # the warm-up set
    rows = []
    pooled = {name: [0, 0.0] for name in engines}  # tokens, seconds over every repeat
    kinds = {name: StepKinds() for name in engines}  # each engine's steps by kind, every repeat
    for rep in range(args.repeats):
        batch = prompts[n * (rep + 1): n * (rep + 2)]
        turns = [(batch, list(engines))] if args.whole_sets else [
            ([prompt], list(engines)[:: 1 if i % 2 == 0 else -1]) for i, prompt in enumerate(batch)]
        counts = {name: [0, 0.0] for name in engines}
        steps_before = {name: llm.get_stats()["num_steps"] for name, llm in engines.items()}
        for turn_prompts, order in turns:
            for name in order:
                with kinds[name].install():
                    start = time.perf_counter()
                    outputs = engines[name].generate(turn_prompts, params, use_tqdm=False)
                    counts[name][1] += time.perf_counter() - start
                counts[name][0] += sum(len(o.outputs[0].token_ids) for o in outputs)
        for name, (tokens, seconds) in counts.items():
            pooled[name][0] += tokens
            pooled[name][1] += seconds
            stats = engines[name].get_stats()
            steps = stats["num_steps"] - steps_before[name]  # engine steps (prefills included)
            rows.append({"repeat": rep, "method": name, "tok_s": round(tokens / seconds, 1), "steps": steps,
                         "ms_per_step": round(1e3 * seconds / max(steps, 1), 4), "gate": stats.get("suffix_gate")})
        plain, suffix = rows[-len(engines)], rows[-len(engines) + 1]
        print(f"repeat {rep}: plain {plain['tok_s']:.1f} tok/s ({plain['steps']} steps, "
              f"{plain['ms_per_step']:.3f} ms), "
              f"suffix {suffix['tok_s']:.1f} ({suffix['tok_s'] / plain['tok_s']:.2f}x; {suffix['steps']} steps, "
              f"{suffix['ms_per_step']:.3f} ms); gate {json.dumps(suffix['gate'])}", flush=True)
    ratios = [rows[i + 1]["tok_s"] / rows[i]["tok_s"] for i in range(0, len(rows), len(engines))]
    plain_tok_s, suffix_tok_s = (pooled[name][0] / pooled[name][1] for name in ("none", "suffix"))
    print(f"pooled: plain {plain_tok_s:.1f} tok/s, suffix {suffix_tok_s:.1f} ({suffix_tok_s / plain_tok_s:.3f}x); "
          f"median of repeats {statistics.median(ratios):.3f}x", flush=True)
    for name, what in (("null", "no drafter's work"), ("tree", f"suffix trees {args.tree}")):
        if name in pooled:
            tok_s = pooled[name][0] / pooled[name][1]
            print(f"pooled: {name} ({what}) {tok_s:.1f} tok/s ({tok_s / plain_tok_s:.3f}x)", flush=True)
    for name, steps in kinds.items():
        print(f"\n{name}, steps by kind over every repeat:\n{format_kinds(steps.table())}", flush=True)
    for llm in engines.values():
        llm.close()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"repeats": rows, "step_kinds": {name: k.table() for name, k in kinds.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
