"""CPU time and wall time of the draft-tree step (issue 28), split into the whole step and its drafting.

Runs the default Qwen3-layout family (target + EAGLE3 head) greedy in float32 on the CPU with a tree
shape, and times every TreeStep.execute and, inside it, the tree drafter (catch-up + depth expansion).
Also counts the head rows the depth expansion runs (the forwards that carry a tree_mask), per step.
CPU seconds (time.process_time) move less with the machine's load than wall seconds; both print.

  python scripts/time_tree_step.py --trees 5,4,16 6,8,32 --num-prompts 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from foretell import LLM, SamplingParams
from foretell.bench.datasets import gsm8k_test_prompts
from foretell.bench import engine_probe as probe

DEFAULTS = os.path.join(os.path.dirname(__file__), "..", "foretell", "default_models")


class Clock:
    """Sums wall and CPU seconds over the calls of one wrapped function."""

    def __init__(self):
        self.calls, self.wall, self.cpu = 0, 0.0, 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls += 1
                self.wall += time.perf_counter() - wall
                self.cpu += time.process_time() - cpu
        return timed

    def per_call_ms(self) -> dict:
        n = max(self.calls, 1)
        return {"calls": self.calls, "wall_ms": 1e3 * self.wall / n, "cpu_ms": 1e3 * self.cpu / n}


def time_tree(args, tree: str, prompts: list[str]) -> dict:
    depth, topk, nodes = (int(x) for x in tree.split(","))
    spec = {"method": "eagle3", "model": args.head, "num_speculative_tokens": depth, "topk": topk,
            "num_draft_tokens": nodes}
    llm = LLM(args.target, speculative_config=spec, dtype="float32", device="cpu",
              kv_cache_memory_bytes=1 << 28, max_num_seqs=max(len(prompts), 1), warm_up="off")
    tree_step = llm.engine.runner.tree_step
    if args.graph_buffers:  # the graphed step's code path, uncaptured (the torch backend: exact buckets)
        probe.use_uncaptured_tree_graphs(llm)
    drafter = tree_step.drafter
    head = drafter.eagle.head
    step_clock, draft_clock = Clock(), Clock()
    frontier_rows = [0]

    def counted_step(tokens, positions, states, metadata, *rest, **kwargs):
        if metadata.tree_mask is not None:  # the depth expansion's forwards (the catch-up has no mask)
            frontier_rows[0] += tokens.shape[0]
        return head_step(tokens, positions, states, metadata, *rest, **kwargs)

    head_step = head.step
    head.step = counted_step
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm up
    tree_step.execute = step_clock.wrap(tree_step.execute)
    drafter.draft = draft_clock.wrap(drafter.draft)
    frontier_rows[0] = 0
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    row = {"tree": tree, "graph_buffers": args.graph_buffers, "prompts": len(prompts), "seconds": wall,
           "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
           "step": step_clock.per_call_ms(), "draft": draft_clock.per_call_ms(),
           "frontier_head_rows_per_draft": frontier_rows[0] / max(draft_clock.calls, 1)}
    del llm
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=os.path.join(DEFAULTS, "qwen3-target"))
    parser.add_argument("--head", default=os.path.join(DEFAULTS, "qwen3-eagle3"))
    parser.add_argument("--num-prompts", type=int, default=4, help="run together as one batch")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--trees", nargs="+", default=["5,4,16"], help="depth,topk,num_draft_tokens")
    parser.add_argument("--num-cpu-threads", type=int, default=1)
    parser.add_argument("--graph-buffers", action="store_true",
                        help="run the tree step's graph buffers uncaptured (runner/tree_graphs.py), "
                             "as the GPU replays them")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    torch.set_num_threads(args.num_cpu_threads)
    prompts = gsm8k_test_prompts(args.num_prompts)
    rows = []
    for tree in args.trees:
        row = time_tree(args, tree, prompts)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{args.num_prompts} GSM8K prompts x {args.max_tokens} tokens, greedy, float32, CPU, "
          f"{args.num_cpu_threads} thread(s), load average {os.getloadavg()[0]:.2f}\n")
    print("| tree | steps | step wall ms | step CPU ms | draft wall ms | draft CPU ms | frontier head rows / draft |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| ({r['tree']}) | {r['step']['calls']} | {r['step']['wall_ms']:.1f} | {r['step']['cpu_ms']:.1f} | "
              f"{r['draft']['wall_ms']:.1f} | {r['draft']['cpu_ms']:.1f} | {r['frontier_head_rows_per_draft']:.1f} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
