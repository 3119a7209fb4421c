"""Where a CPU decode step of the default family goes: per-step time by part, and cProfile.

    python scripts/profile_cpu_step.py [--method none|eagle3] [--num-prompts 4] [--max-tokens 64]
        [--cprofile 30] [--torch-profile 30] [--count-ops] [--forward-loop 200 [--verify-rows 4]]
        [--skip-run] [--dtype auto] [--cpu-compile]

The shipped default Qwen3 family (foretell/default_models), GSM8K prompts one at a time (batch 1),
on the CPU with one torch thread. Each part of Engine.step is wrapped in a timer for the measured
run (after one warm-up request): the scheduler, input tensor building, the target forward (with
the LM head), sampling / acceptance, the drafter, the scheduler's postprocess and the incremental
detokenizer; with a drafter whose loop runs padded (EAGLE3), the verify step's target forward over
the padded buffers and its draft loop instead of the host step's; "rest" is the step's time
outside them. Both wall time and this thread's CPU time are reported: on a machine shared with
other processes the wall time swings, the CPU time much less. --cprofile N prints the N functions
with the most own time; --torch-profile N the N torch ops with the most CPU time (torch.profiler),
each over a second measured run. --count-ops counts the torch calls of one target forward: those
Python makes (a dispatch mode sees them) and every aten op the profiler records under them (a
count that does not move with the machine's load, unlike the timings). --forward-loop N times the
target forward of one decode step N times at the same state, and with --verify-rows R a verify's
forward of R rows alternating with it (both meet the same load: their ratio is what a speculative
step pays for its verify); --skip-run leaves out the measured run of the prompts.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from collections import defaultdict

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import foretell.runner.input_batch as input_batch_module  # noqa: E402
import foretell.tokenizer as tokenizer_module  # noqa: E402
from foretell import LLM, SamplingParams  # noqa: E402
from foretell.bench.datasets import load_prompts  # noqa: E402


class PartTimer:
    """Wall and thread-CPU seconds per named part, summed over the wrapped calls."""

    def __init__(self):
        self.wall = defaultdict(float)
        self.cpu = defaultdict(float)
        self.calls = defaultdict(int)

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[name] += time.perf_counter() - w0
                self.cpu[name] += time.thread_time() - c0
                self.calls[name] += 1

        return timed

    def reset(self):
        self.wall.clear()
        self.cpu.clear()
        self.calls.clear()


def instrument(llm: LLM, timer: PartTimer) -> None:
    """Wrap the parts of one step in timers (instance attributes and the two module-level
    functions the runner and the engine call by name)."""
    engine = llm.engine
    runner = engine.runner
    engine.step = timer.wrap("step", engine.step)
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    engine.scheduler.postprocess = timer.wrap("postprocess", engine.scheduler.postprocess)
    runner.target_forward = timer.wrap("target forward + LM head", runner.target_forward)
    runner.host_step.sample = timer.wrap("sampling / acceptance", runner.host_step.sample)
    runner.host_step.propose = timer.wrap("drafter", runner.host_step.propose)
    if runner.padded_forward is not None:  # the padded verify step (graphed_verify.py), captured or not
        runner.padded_forward.replay = timer.wrap("target forward (padded verify)", runner.padded_forward.replay)
    if runner.draft_graphs is not None:
        runner.draft_graphs.run = timer.wrap("draft loop (padded verify)", runner.draft_graphs.run)
    # the runner's batch is built at its first read (input_batch.DeferredInputBatch), by name there
    input_batch_module.build_input_batch = timer.wrap("input tensors", input_batch_module.build_input_batch)
    detok_add = tokenizer_module.IncrementalDetokenizer.add
    wrapped = timer.wrap("detokenizer", detok_add)
    tokenizer_module.IncrementalDetokenizer.add = lambda self, ids: wrapped(self, ids)


def run(llm, prompts, params) -> tuple[int, int, float]:
    """(steps, generated tokens, wall seconds) of the prompts one at a time (batch 1)."""
    engine = llm.engine
    steps = tokens = 0
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
            steps += 1
    return steps, tokens, time.perf_counter() - t0


def time_forward_loop(llm, prompt: list[int], n: int, verify_rows: int = 0) -> None:
    """The target forward (with the LM head) of one decode step, n times over at the same state
    (it rewrites the same KV slot): the steadiest number on a shared machine. With verify_rows,
    also a verify's forward of that many rows (the decode row and verify_rows - 1 drafts) at the
    same place, the two alternating so that both meet the same load."""
    import statistics
    from dataclasses import replace

    import torch

    from foretell.runner.input_batch import build_input_batch

    engine = llm.engine
    engine.add_request("loop", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    engine.step()  # the prefill
    item = engine.scheduler.schedule().scheduled[0]  # the first decode step, never postprocessed
    # with a drafter that step verifies the prefill's drafts: the decode row alone is timed as such
    item = replace(item, num_new_tokens=1, draft_token_ids=[])
    runner = engine.runner
    block_size = runner.cache_plan.block_size
    items = {"decode forward (1 row)": item}
    if verify_rows > 1:
        if len(item.seq.block_ids) * block_size < item.seq.num_computed_tokens + verify_rows:
            raise ValueError(f"the prompt's last block has no room for {verify_rows} verify rows; try another prompt")
        drafts = prompt[1:verify_rows]  # any tokens: the forward's cost does not depend on them
        items[f"verify forward ({verify_rows} rows)"] = replace(
            item, num_new_tokens=verify_rows, draft_token_ids=drafts)
    wall = {name: [] for name in items}
    cpu = {name: [] for name in items}
    with torch.inference_mode():
        for _ in range(n):
            for name, scheduled in items.items():
                w0, c0 = time.perf_counter(), time.thread_time()
                runner.target_forward(build_input_batch([scheduled], block_size, runner.device))
                wall[name].append(time.perf_counter() - w0)
                cpu[name].append(time.thread_time() - c0)
    engine.abort_request("loop")
    for name in items:
        w, c = wall[name], cpu[name]
        print(f"{name} at context {len(prompt) + 1}, {n} times: wall min {min(w) * 1e3:.3f} "
              f"median {statistics.median(w) * 1e3:.3f} ms; cpu min {min(c) * 1e3:.3f} "
              f"median {statistics.median(c) * 1e3:.3f} ms")


def count_forward_ops(llm, prompt: list[int]) -> None:
    """Torch calls of one target forward (with the LM head) after the prefill, a decode row (or a
    verify's 1 + k rows with a drafter): top-level (what Python dispatches) and every aten op under
    them (torch.profiler's events)."""
    import torch

    from foretell.bench.op_counter import OpCounter
    from foretell.runner.input_batch import build_input_batch

    engine = llm.engine
    engine.add_request("count", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()  # the prefill
    item = engine.scheduler.schedule().scheduled[0]
    runner = engine.runner
    with torch.inference_mode():
        runner.target_forward(build_input_batch([item], runner.cache_plan.block_size, runner.device))
        batch = build_input_batch([item], runner.cache_plan.block_size, runner.device)
        with OpCounter() as count:
            runner.target_forward(batch)
        batch = build_input_batch([item], runner.cache_plan.block_size, runner.device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            runner.target_forward(batch)
    engine.abort_request("count")
    aten = sum(1 for e in prof.events() if e.name.startswith("aten::"))
    print(f"target forward of {batch.num_tokens} row(s): {count.count} top-level torch calls, {aten} aten ops in all")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="none", choices=["none", "eagle3", "draft_model", "ngram"])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    parser.add_argument("--torch-profile", type=int, default=0, metavar="N")
    parser.add_argument("--count-ops", action="store_true",
                        help="count the torch calls of one target forward (top-level and all aten ops)")
    parser.add_argument("--forward-loop", type=int, default=0, metavar="N",
                        help="also time N target forwards of one decode step (min and median)")
    parser.add_argument("--verify-rows", type=int, default=0, metavar="R",
                        help="with --forward-loop, also time a verify forward of R rows (alternating with the decode)")
    parser.add_argument("--cpu-compile", action="store_true",
                        help="the CPU fast path through torch.compile (runner/cpu_compile.py)")
    parser.add_argument("--skip-run", action="store_true",
                        help="skip the measured run of the prompts (only the loops and counts asked for)")
    args = parser.parse_args()

    llm = LLM.default(
        "qwen3", None if args.method == "none" else args.method,
        num_speculative_tokens=None if args.method == "none" else args.k,
        device="cpu", dtype=args.dtype, num_cpu_threads=args.threads, log_stats_interval_s=0,
        cpu_compile=args.cpu_compile,
    )
    tok = llm.tokenizer
    prompts = [tok.encode(p.text) for p in load_prompts("gsm8k", args.num_prompts, seed=0)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    run(llm, prompts[:1], SamplingParams(temperature=0.0, max_tokens=16))  # warm-up

    if not args.skip_run:
        report_parts(llm, prompts, params, args.method)
    if args.count_ops:
        count_forward_ops(llm, prompts[0])
    if args.forward_loop:
        time_forward_loop(llm, prompts[0], args.forward_loop, args.verify_rows)
    if args.cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        run(llm, prompts, params)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.cprofile)
        print(out.getvalue())
    if args.torch_profile:
        import torch

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run(llm, prompts, params)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.torch_profile))


def report_parts(llm, prompts, params, method: str) -> None:
    """The measured run of the prompts, its time per step by part (wall and thread CPU)."""
    timer = PartTimer()
    instrument(llm, timer)
    steps, tokens, wall = run(llm, prompts, params)
    print(f"method {method}, dtype {llm.engine.runner.dtype}, {len(prompts)} prompts, "
          f"{tokens} tokens in {steps} steps: {tokens / wall:.1f} tok/s, "
          f"{wall / steps * 1e3:.2f} ms/step wall")
    parts = [n for n in timer.wall if n != "step"]
    step_wall, step_cpu = timer.wall["step"], timer.cpu["step"]
    print(f"{'part':<28}{'calls':>7}{'wall ms/step':>14}{'cpu ms/step':>13}{'cpu share':>11}")
    for name in parts + ["rest"]:
        if name == "rest":
            w = step_wall - sum(timer.wall[n] for n in parts if n != "detokenizer")
            c = step_cpu - sum(timer.cpu[n] for n in parts if n != "detokenizer")
            calls = steps
        else:
            w, c, calls = timer.wall[name], timer.cpu[name], timer.calls[name]
        print(f"{name:<28}{calls:>7}{w / steps * 1e3:>14.3f}{c / steps * 1e3:>13.3f}"
              f"{c / step_cpu * 100:>10.1f}%")
    print(f"{'step (all)':<28}{steps:>7}{step_wall / steps * 1e3:>14.3f}{step_cpu / steps * 1e3:>13.3f}")
    print("(the detokenizer runs inside postprocess's caller, the engine loop: counted in rest)")


if __name__ == "__main__":
    main()
