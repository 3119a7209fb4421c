"""Where a draft-tree step's time goes (issue 28): per-phase host and device time of TreeStep.execute,
and (on CUDA) a torch.profiler summary of the kernels and launches each phase issues.

The phases are the step's own methods, wrapped on one engine's instances (nothing in the package
changes; the wrappers go away with the engine):

  engine step      Engine.step: schedule, the runner's step, results applied
  runner execute   ModelRunner.execute (the tree step and the runner's bookkeeping around it)
  tree step        TreeStep.execute; "host between" = tree step - its phases below (build_input_batch,
                   prompt logprobs, the step's Python glue)
  trees            TreeStep._scheduled_trees: the drafted trees cut and stacked per node count
  mask             TreeStep._tree_batch: positions at root + depth, the ancestor mask scatter
  verify forward   TreeStep._verify_forward: the (bucket, T) graph's replay (mask copy included) or eager
  sample           TreeStep._sample, of which
    verification     TreeStep._verify: greedy / drawn / sampled path per group
    compaction       TreeStep._compact: the accepted path's K/V moved, every target layer
    graphed draft    TreeStep._draft_after_verify: after a graphed verify, the catch-up (padded to
                     depth + 1 rows) and the expansion as one replay, before the read
                     (TreeDraftGraphs.run_after_verify; steps it serves skip "draft" below)
    (the rest: argmax, the results' device read, plain rows' sampling)
  draft            TreeStep._draft, of which
    draft batch      HostStep.draft_batch: the catch-up's inputs
    catch-up         Eagle3Proposer.catch_up: the head over the accepted path's rows (eager)
    expansion        TreeDraftGraphs.run (graph replay + tree copy-out) or ModelTreeDrafter.expand

Each wrapped call records host perf_counter time and, on CUDA, a pair of CUDA events on the current
stream (no synchronisation inside the step: the device span is when the GPU reached the phase's first
and last marker, which includes the GPU waiting for the host's launches). `--sync` synchronises at
every phase boundary instead: device time of each phase alone, at the cost of the overlap.

  python scripts/tree_step_phases.py OUT_DIR [--tree 6,4,16] [--new-tokens 128] [--sync] [--tiny]

check_trees_gpu.py --parts p runs the same thing (its part p).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from foretell import LLM, SamplingParams  # noqa: E402
from foretell.bench import engine_probe as probe  # noqa: E402
from foretell.bench.bench_models import eagle3_bench_models, synthetic_prompt  # noqa: E402

LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cudaMemcpyAsync", "cudaMemsetAsync")
PHASE_PREFIX = "tree::"


class PhaseTimer:
    """Wraps methods of live objects; per call: host seconds and (CUDA) a start/end event pair."""

    def __init__(self, device: torch.device, sync: bool = False):
        self.device = device
        self.sync = sync and device.type == "cuda"
        self.enabled = False
        self.host: dict[str, list[float]] = defaultdict(list)
        self.events: dict[str, list[tuple]] = defaultdict(list)
        self.order: list[str] = []
        self.restore: list[tuple[object, str, object]] = []  # (object, attribute, its instance value before)

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        self.order.append(name)
        cuda = self.device.type == "cuda"

        def timed(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            if self.sync:
                torch.cuda.synchronize(self.device)
            start_event = end_event = None
            if cuda:
                start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start_event.record()
            start = time.perf_counter()
            try:
                with torch.profiler.record_function(PHASE_PREFIX + name):
                    return fn(*args, **kwargs)
            finally:
                if cuda:
                    end_event.record()
                if self.sync:
                    torch.cuda.synchronize(self.device)
                self.host[name].append(time.perf_counter() - start)
                if cuda:
                    self.events[name].append((start_event, end_event))

        self.restore.append((obj, attr, vars(obj).get(attr)))
        setattr(obj, attr, timed)

    def unwrap(self) -> None:
        for obj, attr, previous in reversed(self.restore):
            if previous is not None:
                setattr(obj, attr, previous)  # an instance attribute before: put it back
            else:
                delattr(obj, attr)  # the class's method shows again
        self.restore.clear()

    def reset(self) -> None:
        self.host.clear()
        self.events.clear()

    def table(self, steps: int) -> dict[str, dict]:
        """Per phase: calls, host ms per step, device span ms per step (CUDA), share of the tree step."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        rows = {}
        for name in self.order:
            host = self.host.get(name, [])
            row = {"calls": len(host), "host_ms_per_step": 1e3 * sum(host) / max(steps, 1)}
            pairs = self.events.get(name, [])
            if pairs:
                row["device_ms_per_step"] = sum(s.elapsed_time(e) for s, e in pairs) / max(steps, 1)
            rows[name] = row
        step = rows.get("tree step")
        if step is not None:
            inner = [n for n in ("trees", "mask", "verify forward", "sample", "draft") if n in rows]
            between = {"calls": step["calls"],
                       "host_ms_per_step": step["host_ms_per_step"] - sum(rows[n]["host_ms_per_step"] for n in inner)}
            rows["host between"] = between
            total = step["host_ms_per_step"] or 1.0
            for row in rows.values():
                row["share_of_tree_step"] = row["host_ms_per_step"] / total
        return rows


def instrument(llm: LLM, timer: PhaseTimer) -> None:
    engine = llm.engine
    runner = engine.runner
    step = runner.tree_step
    if step is None:
        raise ValueError("the engine runs no draft trees: give speculative_config topk > 1")
    timer.wrap(engine, "step", "engine step")
    timer.wrap(runner, "execute", "runner execute")
    timer.wrap(step, "execute", "tree step")
    timer.wrap(step, "_scheduled_trees", "trees")
    timer.wrap(step, "_tree_batch", "mask")
    timer.wrap(step, "_verify_forward", "verify forward")
    timer.wrap(step, "_sample", "sample")
    timer.wrap(step, "_verify", "verification")
    timer.wrap(step, "_compact", "compaction")
    timer.wrap(step, "_draft_after_verify", "graphed draft")
    timer.wrap(step, "_draft", "draft")
    timer.wrap(step.host_step, "draft_batch", "draft batch")
    timer.wrap(step.drafter.proposer, "catch_up", "catch-up")
    if step.drafter.graphs is not None:
        timer.wrap(step.drafter.graphs, "run", "expansion")
    else:
        timer.wrap(step.drafter, "expand", "expansion")


def kernel_summary(prof, steps: int, top: int = 25) -> dict:
    """From a torch.profiler run: the top kernels by device time (count and ms per step), and per
    phase the launches (kernel launches, graph launches, copies) its host code issued."""
    out: dict = {"kernels": [], "launches_per_step": {}}
    averages = prof.key_averages()
    kernels = []
    for a in averages:
        device_us = getattr(a, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(a, "self_cuda_time_total", 0)
        on_device = str(getattr(a, "device_type", "")).endswith("CUDA") or getattr(a, "cpu_time_total", 0) == 0
        if device_us and on_device and not a.key.startswith(PHASE_PREFIX):
            kernels.append({"kernel": a.key[:100], "count_per_step": a.count / max(steps, 1),
                            "device_ms_per_step": device_us / 1e3 / max(steps, 1)})
    kernels.sort(key=lambda k: -k["device_ms_per_step"])
    out["kernels"] = kernels[:top]
    out["kernel_device_ms_per_step"] = sum(k["device_ms_per_step"] for k in kernels)
    out["kernels_per_step"] = sum(k["count_per_step"] for k in kernels)
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for event in prof.events():
        if event.name not in LAUNCH_CALLS:
            continue
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith(PHASE_PREFIX):
                counts[parent.name[len(PHASE_PREFIX):]][event.name] += 1
            parent = parent.cpu_parent
    out["launches_per_step"] = {phase: {k: v / max(steps, 1) for k, v in calls.items()}
                                for phase, calls in counts.items()}
    return out


def measure(llm: LLM, new_tokens: int, sync: bool = False, profile: bool = True) -> dict:
    """One request of new_tokens at batch 1 after a warm-up run: the phase table, then (CUDA, profile)
    a second run under torch.profiler for the kernel summary."""
    device = probe.engine_device(llm)
    timer = PhaseTimer(device, sync)
    instrument(llm, timer)
    prompt = synthetic_prompt(probe.vocab_size(llm), 128)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    try:
        llm.generate([prompt], params, use_tqdm=False)  # compiled / captured
        timer.enabled = True
        start = time.perf_counter()
        outs = llm.generate([prompt], params, use_tqdm=False)
        wall = time.perf_counter() - start
        steps = len(timer.host.get("tree step", []))
        report = {"tokens": len(outs[0].outputs[0].token_ids), "wall_s": wall, "tree_steps": steps,
                  "tok_s": len(outs[0].outputs[0].token_ids) / wall, "sync": timer.sync,
                  "phases": timer.table(steps)}
        if profile and device.type == "cuda":
            timer.reset()
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                llm.generate([prompt], params, use_tqdm=False)
            torch.cuda.synchronize(device)
            report["profiler"] = kernel_summary(prof, len(timer.host.get("tree step", [])))
    finally:
        timer.enabled = False
        timer.unwrap()
    return report


def print_report(report: dict) -> None:
    print(f"\n{report['tree_steps']} tree steps, {report['tokens']} tokens, {report['tok_s']:.1f} tok/s"
          f"{' (synchronised at every phase)' if report['sync'] else ''}\n")
    print("| phase | calls | host ms / step | device span ms / step | share of tree step |")
    print("|---|---|---|---|---|")
    for name, row in report["phases"].items():
        device = row.get("device_ms_per_step")
        print(f"| {name} | {row['calls']} | {row['host_ms_per_step']:.3f} | "
              f"{'-' if device is None else f'{device:.3f}'} | {row.get('share_of_tree_step', 0):.1%} |")
    prof = report.get("profiler")
    if prof:
        print(f"\nkernels: {prof['kernels_per_step']:.1f} a step, {prof['kernel_device_ms_per_step']:.3f} ms of device "
              "time a step")
        print("\n| phase | launches / step |\n|---|---|")
        for phase, calls in prof["launches_per_step"].items():
            print(f"| {phase} | {', '.join(f'{k} {v:.1f}' for k, v in sorted(calls.items()))} |")
        print("\n| kernel | count / step | device ms / step |\n|---|---|---|")
        for k in prof["kernels"]:
            print(f"| {k['kernel']} | {k['count_per_step']:.1f} | {k['device_ms_per_step']:.4f} |")


def tree_engine(target: str, head: str, options: dict, tree: str, mean_length: float) -> LLM:
    depth, topk, nodes = (int(x) for x in tree.split(","))
    speculative = {"method": "eagle3", "model": head, "num_speculative_tokens": depth, "topk": topk,
                   "num_draft_tokens": nodes, "simulate_acceptance": {"mean_acceptance_length": mean_length}}
    return LLM(target, speculative_config=speculative, skip_tokenizer_init=True, max_num_seqs=1,
               log_stats_interval_s=0, **options)


def main() -> int:
    from check_trees_gpu import TREE_LENGTH

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--tree", default="6,4,16", help="depth,topk,num_draft_tokens")
    parser.add_argument("--mean-length", type=float, default=TREE_LENGTH, help="simulated best-path mean length")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--sync", action="store_true", help="synchronise at every phase boundary")
    parser.add_argument("--tiny", action="store_true", help="tiny random models on the CPU (a smoke test)")
    args = parser.parse_args()
    target, head, options = eagle3_bench_models(args.tiny)
    llm = tree_engine(target, head, options, args.tree, args.mean_length)
    report = {"tree": args.tree, "mean_length": args.mean_length, **measure(llm, args.new_tokens, args.sync)}
    llm.close()
    print_report(report)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "tree_step_phases.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
