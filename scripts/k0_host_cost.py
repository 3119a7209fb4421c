"""Issue 28: the host's work per step of an adaptive EAGLE3 engine held at k = 0 against an engine
with no drafter, on the CPU with the target's forward stubbed (bench/host_overhead.py's
--stub-forward: the GPU's queued-ahead host path, minus the CUDA calls themselves).

    python scripts/k0_host_cost.py [--batches 1,16,256] [--max-tokens 48] [--repeat 3] [--json OUT]

The adaptive engine (num_speculative_tokens "auto", K = 4) gets a fixed StepCostModel under which
any drafting step costs a thousand times a plain one, so it chooses k = 0 on every step (the
H200's batch-256 case at a simulated mean length of 1.5); its chosen-k histogram is printed to
show it. Prints, per batch size, the median over repeats of each engine's per-step host CPU
median (us) and the difference.

The uncaptured graph buffers' forward takes the argmax of the stub's logits on the CPU ([batch,
vocab]: ~2 ms a step at batch 256 here, inside a CUDA graph on the GPU) outside the parts the probe
counts as the forward; for the stub's constant token this script makes that argmax the constant
(cuda_graph.argmax_rows, for the run), so the host figures hold the host's work only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from foretell import LLM, SamplingParams  # noqa: E402
from foretell.bench.host_overhead import PARTS, measure_host_overhead  # noqa: E402
from foretell.spec_decode.adaptive import StepCostModel  # noqa: E402


def force_k0(llm: LLM) -> None:
    """Every drafting step priced a thousand times a plain one: adaptive chooses k = 0."""
    policy = llm.engine.adaptive
    k = policy.max_k
    policy.costs = StepCostModel((1,), ((1e-3,) + (1.0,) * k,))


def engine(method: str | None, max_num_seqs: int) -> LLM:
    llm = LLM.default("qwen3", method, num_speculative_tokens="auto" if method else None, device="cpu",
                      num_cpu_threads=1, log_stats_interval_s=0, async_scheduling="on", max_num_seqs=max_num_seqs)
    if method:
        force_k0(llm)
    return llm


def constant_argmax(token: int):
    """cuda_graph.argmax_rows for the stub's constant logits: [rows] of `token`, no arithmetic."""
    import torch

    return lambda logits: torch.full((logits.shape[0],), token, dtype=torch.int64, device=logits.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,256")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    engines = {name: engine(method, max(batches)) for name, method in (("none", None), ("eagle3 k=0", "eagle3"))}
    from foretell.runner import cuda_graph

    vocab = engines["none"].engine.runner.vocab_size
    cuda_graph.argmax_rows = constant_argmax(min(1000, vocab - 1))  # the stub's token (bench/stub_target.py)
    for batch in batches:
        prompts = [[(7 * i + j) % 1000 + 1 for j in range(32)] for i in range(batch)]
        row = {"batch": batch}
        for name, llm in engines.items():
            results = [measure_host_overhead(llm, prompts, params, batch_size=batch, stub_forward=True, stub_seed=r)
                       for r in range(args.repeat)]
            row[name] = {part: statistics.median(r.cpu_us_median[part] for r in results)
                         for part in PARTS + ("host",)}
            row[name]["steps"] = results[0].num_steps
        rows.append(row)
        print(f"batch {batch}: " + "; ".join(f"{name} host {row[name]['host']:.0f} us ({row[name]['steps']} steps)"
                                           for name in engines)
              + f"; difference {row['eagle3 k=0']['host'] - row['none']['host']:.0f} us")
        for part in PARTS:
            print(f"    {part:<20}" + "".join(f"{row[name][part]:>10.1f}" for name in engines))
    print("eagle3 chosen k histogram:", engines["eagle3 k=0"].get_stats()["adaptive_chosen_k_histogram"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
