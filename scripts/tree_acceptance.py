"""Real acceptance of draft trees against the chain (issue 28's bar): the default Qwen3-layout family
(its target and its EAGLE3 head, or with --method draft_model its draft LM), greedy, GSM8K test
prompts, float32 on the CPU (or --device cuda, --dtype bfloat16).

For each config: mean acceptance length (1 + accepted per verify step), acceptance per depth, and
whether the output equals plain greedy on every prompt. Prints a table and writes JSON.

  python scripts/tree_acceptance.py --num-prompts 64 --max-tokens 128 \
      --trees 5,4,16 6,8,32 --output-json tree_acceptance.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from foretell import LLM, SamplingParams
from foretell.bench.datasets import gsm8k_test_prompts

DEFAULTS = os.path.join(os.path.dirname(__file__), "..", "foretell", "default_models")


def parse_tree(text: str) -> dict:
    depth, topk, nodes = (int(x) for x in text.split(","))
    return {"num_speculative_tokens": depth, "topk": topk, "num_draft_tokens": nodes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=os.path.join(DEFAULTS, "qwen3-target"))
    parser.add_argument("--method", choices=["eagle3", "draft_model"], default="eagle3")
    parser.add_argument("--head", help="the drafter's folder (default: the family's EAGLE3 head or draft LM)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--chain-k", type=int, default=3, help="the chain to compare against")
    parser.add_argument("--trees", nargs="+", default=["5,4,16", "6,8,32"], help="depth,topk,num_draft_tokens")
    parser.add_argument("--num-cpu-threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    torch.set_num_threads(args.num_cpu_threads)
    drafter = args.head or os.path.join(DEFAULTS, "qwen3-eagle3" if args.method == "eagle3" else "qwen3-draft")
    prompts = gsm8k_test_prompts(args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    engine = dict(dtype=args.dtype, device=args.device, kv_cache_memory_bytes=1 << 30, max_num_seqs=len(prompts),
                  warm_up="off" if args.device == "cpu" else "auto")  # every prompt in one batch
    configs = {"plain": None, f"chain k={args.chain_k}": {"num_speculative_tokens": args.chain_k}}
    configs.update({f"tree {t}": parse_tree(t) for t in args.trees})
    rows, baseline = {}, None
    for name, shape in configs.items():
        spec = None if shape is None else {"method": args.method, "model": drafter, **shape}
        llm = LLM(args.target, speculative_config=spec, **engine)
        start = time.perf_counter()
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        row = {"speculative_config": spec, "seconds": time.perf_counter() - start,
               "output_tokens": sum(map(len, tokens))}
        if baseline is None:
            baseline = tokens
        else:
            stats = llm.get_stats()
            drafts = stats["num_drafts"]
            row.update(mean_acceptance_length=stats["mean_acceptance_length"], num_drafts=drafts,
                       acceptance_per_depth=[a / drafts for a in stats["accepted_per_position"]],
                       greedy_equal_prompts=sum(x == y for x, y in zip(tokens, baseline)))
        rows[name] = row
        print(f"{name}: {json.dumps(row)}", flush=True)
        del llm
    print(f"\n{args.method}, {len(prompts)} GSM8K test prompts x {args.max_tokens} tokens, greedy, {args.dtype}, "
          f"{args.device}\n")
    print("| config | mean acceptance length | per depth | greedy = plain |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        if "mean_acceptance_length" in row:
            depth = " / ".join(f"{r:.3f}" for r in row["acceptance_per_depth"])
            print(f"| {name} | {row['mean_acceptance_length']:.2f} | {depth} | "
                  f"{row['greedy_equal_prompts']} / {len(prompts)} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"prompts": len(prompts), "max_tokens": args.max_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
