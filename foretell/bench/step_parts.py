"""Where an engine step's wall time goes, part by part: `python -m foretell.bench.step_parts`.

Wraps the engine's and runner's step parts (the scheduler, the runner's execute, the step pipeline's
launch / take / finish, the padded verify's launch and its pieces, graph replays, the read-back's
wait, a host drafter's propose, adaptive speculation's choice and observation, the engine's result
processing) in perf_counter timers, runs requests, and reports per engine step the microseconds each
part took (parts nest: execute holds launch, launch holds replay, ...) and how often it ran, beside
the median and longest step and the Triton compilations of the measured run (a mean per step hides
one slow step: a kernel compiled in serving), and the steps by kind (bench/step_kinds.py: drafting,
fallback, plain, prefill; each kind's time and tokens). The parts are the ones the twentieth GPU session
(docs/perf-log.md) needed to tell host work on the critical path from device waits.
bench/host_overhead.py answers another question: the host's work apart from the model's arithmetic
(forwards taken out or stubbed, coarse parts, nothing patched on the classes); this probe times a
real run, device waits included, down to the step pipeline's pieces, by wrapping the classes'
functions for the measured run.

    python -m foretell.bench.step_parts [--method suffix|eagle3|...|none] [--k 16]
        [--dataset repetitive] [--num-prompts 8] [--max-tokens 128] [--batch-size 1]
        [--device auto] [--output-json parts.json]

Greedy, EOS ignored, the default family's target (what LLM() loads) with the given drafter, a
warm-up run of the same requests first (so a drafter with a cross-request cache has seen them:
the measured run re-asks them), then one measured run; tok/s, steps and the parts' table print.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

from foretell.bench.step_kinds import StepKinds, format_kinds

# (module, owner attribute or None for a module function, function name): the parts timed
PARTS = (
    ("foretell.engine.engine", "Engine", "step"),
    ("foretell.engine.engine", "Engine", "_apply_result"),
    ("foretell.engine.engine", "Engine", "_finish_step"),
    ("foretell.engine.scheduler", "Scheduler", "schedule"),
    ("foretell.runner.model_runner", "ModelRunner", "execute"),
    ("foretell.runner.input_batch", None, "build_input_batch"),  # the scheduler's batch, built at its first read
    ("foretell.runner.model_runner", None, "propose_from_tokens"),
    ("foretell.runner.step_pipeline", "StepPipeline", "take"),
    ("foretell.runner.step_pipeline", "StepPipeline", "launch"),
    ("foretell.runner.step_pipeline", "StepPipeline", "finish"),
    ("foretell.runner.step_pipeline", "HostCopy", "read"),
    ("foretell.runner.graphed_verify", "GraphedVerify", "launch"),
    ("foretell.runner.graphed_verify", "GraphedVerify", "launch_after"),
    ("foretell.runner.graphed_verify", "GraphedVerify", "_verify_on_device"),
    ("foretell.runner.graphed_verify", "GraphedVerify", "_launched"),
    ("foretell.runner.launched_verify", "LaunchedVerify", "results"),
    ("foretell.runner.cuda_graph", "CudaGraphRunner", "run"),
    ("foretell.spec_decode.adaptive", "AdaptiveDraftLength", "choose"),
    ("foretell.spec_decode.adaptive", "AdaptiveDraftLength", "observe"),
)


STEP_LABEL = "Engine.step"


class PartTimers:
    """Seconds and calls per part while installed (install() is a context manager: the wrapped
    functions are put back on exit)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.step_seconds: list[float] = []  # each Engine.step's own: a spike (a compile) shows here

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.step_seconds.clear()

    def _timed(self, fn, label: str):
        seconds, calls = self.seconds, self.calls
        steps = self.step_seconds if label == STEP_LABEL else None

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                seconds[label] += elapsed
                calls[label] += 1
                if steps is not None:
                    steps.append(elapsed)

        return timed

    @contextmanager
    def install(self, parts=PARTS) -> Iterator["PartTimers"]:
        import importlib

        saved = []
        try:
            for module_name, owner_name, name in parts:
                module = importlib.import_module(module_name)
                owner = module if owner_name is None else getattr(module, owner_name)
                label = name if owner_name is None else f"{owner_name}.{name}"
                saved.append((owner, name, getattr(owner, name)))
                setattr(owner, name, self._timed(getattr(owner, name), label))
            yield self
        finally:
            for owner, name, fn in reversed(saved):
                setattr(owner, name, fn)

    def step_spread(self) -> dict:
        """The engine steps' median and longest milliseconds (0.0 before any step)."""
        ordered = sorted(self.step_seconds)
        if not ordered:
            return {"median_ms": 0.0, "longest_ms": 0.0}
        return {"median_ms": round(1e3 * ordered[len(ordered) // 2], 4), "longest_ms": round(1e3 * ordered[-1], 4)}

    def per_step(self) -> dict:
        """{part: {"us": microseconds per engine step, "calls": calls per step}}, most time first."""
        steps = max(self.calls.get("Engine.step", 0), 1)
        return {label: {"us": round(1e6 * s / steps, 1), "calls": round(self.calls[label] / steps, 2)}
                for label, s in sorted(self.seconds.items(), key=lambda item: -item[1])}


def measure(method: str, k: int, dataset: str, num_prompts: int, max_tokens: int, batch_size: int,
            device: str = "auto") -> dict:
    """One engine (the default target, drafter `method`, none: plain), a warm-up run, then the
    measured run under the timers: tok/s, engine steps, the parts per step and get_stats()' pipeline
    counts."""
    from foretell import LLM, SamplingParams
    from foretell.bench.datasets import load_prompts
    from foretell.defaults import default_speculative_config, default_target

    if method == "none":
        spec = None
    elif method in ("ngram", "suffix"):
        spec = {"method": method, "num_speculative_tokens": k}
    else:
        spec = default_speculative_config("qwen3", method, k)
    prompts = [p.text if p.text is not None else {"prompt_token_ids": p.token_ids}
               for p in load_prompts(dataset, num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    timers = PartTimers()
    kinds = StepKinds()
    with LLM(default_target("qwen3"), speculative_config=spec, device=device, max_num_seqs=batch_size,
             log_stats_interval_s=0) as llm:
        llm.generate(prompts, params, use_tqdm=False)
        before = llm.get_stats()
        with timers.install(), kinds.install():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
        after = llm.get_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    steps = timers.calls.get("Engine.step", 0)
    return {
        "method": method, "k": k if spec else 0, "batch_size": batch_size, "tok_s": tokens / wall,
        "tokens": tokens, "steps": steps, "ms_per_step": 1000 * wall / max(steps, 1),
        "steps_queued_ahead_used": after["steps_queued_ahead_used"] - before["steps_queued_ahead_used"],
        "jit_compiles": after["jit_compiles"] - before["jit_compiles"],  # Triton compilations in the measured run
        **timers.step_spread(),
        "parts": timers.per_step(),
        "step_kinds": kinds.table(),
    }


def format_parts(result: dict) -> str:
    lines = [f"{result['method']} k={result['k']} batch {result['batch_size']}: {result['tok_s']:.1f} tok/s, "
             f"{result['steps']} steps ({result['ms_per_step']:.3f} ms a step, "
             f"{result['steps_queued_ahead_used']} queued ahead and used; median step {result['median_ms']:.3f} ms, "
             f"longest {result['longest_ms']:.3f}, {result['jit_compiles']} compilations)",
             "| part | us a step | calls a step |", "|---|---|---|"]
    lines += [f"| {label} | {part['us']:.1f} | {part['calls']:.2f} |" for label, part in result["parts"].items()]
    return "\n".join(lines) + "\n\n" + format_kinds(result["step_kinds"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="suffix", help="suffix, ngram, eagle3, draft_model, or none")
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--dataset", default="repetitive")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1, help="max_num_seqs")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if args.k < 1 or args.num_prompts < 1 or args.max_tokens < 1 or args.batch_size < 1:
        parser.error("--k, --num-prompts, --max-tokens and --batch-size must be >= 1")
    result = measure(args.method, args.k, args.dataset, args.num_prompts, args.max_tokens, args.batch_size,
                     args.device)
    print(format_parts(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
