"""The target's greedy outputs of a dataset's prompts, kept on disk: what bench/suffix_gate_sim.py
replays the suffix drafter over (`python -m foretell.bench.suffix_traces --dataset gsm8k`).

Why: at temperature 0 the drafts change speed only, never the tokens, so one plain greedy run of
the target fixes everything a speculative run can see: the history at every step, and for any
draft how many of its tokens the verify would accept (the length of its agreement with the
output). Recording the outputs once (the default family's target on the CPU) lets a simulation
replay the real drafter and its gate under any step costs, deterministically and without a GPU.

A trace file is JSON: {"dataset", "max_tokens", "ignore_eos", "prompts": [[ids]], "outputs":
[[ids]]} with the prompts as `foretell bench` tokenizes them (no chat template) and each output
as the engine returned it (ending at EOS unless ignore_eos). The bench's warm-up is not recorded:
the simulation rebuilds it from the same outputs (bench/suffix_gate_sim.py).
"""

from __future__ import annotations

import argparse
import json
import os

#: Where traces are kept unless a path is given (one file per dataset, prompts, tokens).
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "foretell", "suffix_traces")


def trace_path(dataset: str, num_prompts: int, max_tokens: int, ignore_eos: bool) -> str:
    """The cache file of one trace's settings."""
    tail = "-ignore-eos" if ignore_eos else ""
    return os.path.join(CACHE_DIR, f"{dataset}-{num_prompts}x{max_tokens}{tail}.json")


def record(dataset: str, num_prompts: int, max_tokens: int, ignore_eos: bool) -> dict:
    """The default target's greedy outputs of the dataset's prompts (float32, on the CPU)."""
    from foretell import LLM, SamplingParams
    from foretell.bench.datasets import load_prompts
    from foretell.bench.offline import tokenize_prompts
    from foretell.defaults import default_target

    llm = LLM(default_target(), dtype="float32", device="cpu", num_kv_blocks=2048, max_num_seqs=16,
              log_stats_interval_s=0)
    try:
        prompts = tokenize_prompts(load_prompts(dataset, num_prompts), llm.engine.tokenizer, chat=False)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs = [list(r.outputs[0].token_ids) for r in results]
    finally:
        llm.close()
    return {"dataset": dataset, "max_tokens": max_tokens, "ignore_eos": ignore_eos,
            "prompts": [list(p) for p in prompts], "outputs": outputs}


def load_or_record(dataset: str, num_prompts: int, max_tokens: int, ignore_eos: bool,
                   path: str | None = None) -> dict:
    """The trace at path (default: the cache file of these settings), recorded first if missing."""
    path = path or trace_path(dataset, num_prompts, max_tokens, ignore_eos)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    trace = record(dataset, num_prompts, max_tokens, ignore_eos)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(trace, f)
    return trace


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="gsm8k")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--out", default=None, help="the trace file (default: the cache's)")
    args = parser.parse_args(argv)
    trace = load_or_record(args.dataset, args.num_prompts, args.max_tokens, args.ignore_eos, args.out)
    lengths = [len(o) for o in trace["outputs"]]
    print(f"{len(lengths)} outputs, {sum(lengths)} tokens, "
          f"{args.out or trace_path(args.dataset, args.num_prompts, args.max_tokens, args.ignore_eos)}")


if __name__ == "__main__":
    main()
