"""The suffix drafter's host time per request inside a real engine, split by where it goes:
`python -m foretell.bench.suffix_request_cost [--dataset gsm8k|repetitive] [--num-prompts 16]`.

Why: on a GPU with a small target a plain step is a fraction of a millisecond of host work, so a
cost the drafter pays once per request (indexing a prompt, caching a response, evicting old ones,
a new sequence's bookkeeping) weighs as much as its per-step work. This runs the default target on
the CPU (greedy, fixed output lengths) with the suffix drafter, requests in sequence
(--batch-size at once), and times the drafter's parts with this thread's CPU clock (a shared
machine inflates wall times):
  prompt    a request's first observe(), the call that meets its prompt (stored, or indexed
            when it looks up)
  index     SuffixIndex.extend calls of more than one token (the lazy indexing of a prompt or of
            the tokens a paused sequence stored) - inside the observe() calls
  cache     GlobalSuffixCache.add less its evictions (the response copied and indexed)
  evict     GlobalSuffixCache.evict_oldest
  forget    SuffixProposer.forget in all (cache and evict inside it)
  gate      StepCostBar.begin_step (the "auto" gate's bookkeeping)
  step      SuffixProposer.propose per call (everything a step's drafting costs: observe, lookups,
            drafts, gate); its median, p99 and max
and Python's garbage collections (count and time) that ran inside the drafter's calls and outside
them. A first pass over the prompts fills the global cache as a bench's warm-up does
(--passes 2: the second pass is reported, the repeat a bench measures).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections import defaultdict

from foretell.spec_decode import suffix, suffix_cache, suffix_gate, suffix_tree

PARTS = ("prompt", "prompt_index", "cache", "evict", "forget")  # once per request
STEP_PARTS = ("gate", "observe", "extend", "lookup", "draft")  # inside a step's propose
WARMUP_MAX_TOKENS = 16  # the bench's short warm-up run (bench/offline.py)


class DrafterClock:
    """Thread CPU seconds per drafter part (module docstring), gathered while installed."""

    def __init__(self, steps_only: bool = False):
        self.steps_only = steps_only  # time propose and forget only (no nested timers in a step's time)
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self.steps: list[tuple[float, dict[str, float]]] = []  # per propose: its time, its parts' times
        self._step_parts: dict[str, float] | None = None  # the parts of the propose running now
        self.depth = 0  # inside the drafter (for the garbage collections' attribution)
        self.gc_inside: list[float] = []
        self.gc_outside: list[float] = []
        self._gc_start = 0.0

    def record(self, part: str, seconds: float) -> None:
        if part == "step":
            self.steps.append((seconds, self._step_parts or {}))
            self._step_parts = None
            return
        self.seconds[part].append(seconds)
        if self._step_parts is not None:
            self._step_parts[part] = self._step_parts.get(part, 0.0) + seconds

    def _wrap(self, owner, name: str, part_of):
        """Replace owner.name by a timed call; part_of(self_obj, args) -> the part's name or None."""
        original = getattr(owner, name)
        clock_ = self

        def timed(obj, *args, **kwargs):
            part = part_of(obj, args)
            if part == "step":
                clock_._step_parts = {}
            clock_.depth += 1
            c0 = time.thread_time()
            try:
                return original(obj, *args, **kwargs)
            finally:
                if part is not None:
                    clock_.record(part, time.thread_time() - c0)
                clock_.depth -= 1

        setattr(owner, name, timed)
        return original

    def _gc_event(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            (self.gc_inside if self.depth else self.gc_outside).append(time.perf_counter() - self._gc_start)

    @contextlib.contextmanager
    def installed(self):
        """The drafter's classes timed (class attributes patched, restored on exit)."""
        Proposer, Cache, Index, Bar = (suffix.SuffixProposer, suffix_cache.GlobalSuffixCache,
                                       suffix_tree.SuffixIndex, suffix_gate.StepCostBar)

        def first_observe(proposer, args):
            key = args[0]
            return "prompt" if key is not None and key not in proposer.states else "observe"

        def extend(index, args):
            return "prompt_index" if not index.tokens else "extend"

        parts = [(Proposer, "propose", "step"), (Proposer, "observe", first_observe), (Proposer, "forget", "forget"),
                 (Proposer, "draft", "draft"), (Cache, "add", "cache_all"), (Cache, "evict_oldest", "evict"),
                 (Index, "extend", extend), (Index, "lookup", "lookup"), (Bar, "begin_step", "gate")]
        if self.steps_only:
            parts = parts[:1] + parts[2:3]
        patched = []
        for owner, name, part in parts:
            part_of = part if callable(part) else (lambda o, a, _part=part: _part)
            patched.append((owner, name, self._wrap(owner, name, part_of)))
        gc.callbacks.append(self._gc_event)
        try:
            yield self
        finally:
            gc.callbacks.remove(self._gc_event)
            for owner, name, original in patched:
                setattr(owner, name, original)

    def report(self, num_requests: int) -> dict:
        """Microseconds per request of each part, per step of each step part, and the steps'
        distribution (median, p99, max) with the parts of the largest."""
        s = self.seconds
        total = {part: sum(values) for part, values in s.items()}
        total["cache"] = total.get("cache_all", 0.0) - total.get("evict", 0.0)
        steps = sorted(self.steps, key=lambda step: step[0])
        times = [t for t, _ in steps] or [0.0]
        n = len(times)

        def us(x):
            return round(1e6 * x, 1)

        prompt_in_steps = sum(parts.get("prompt", 0.0) for _, parts in steps)
        step_parts = {part: us(sum(parts.get(part, 0.0) for _, parts in steps) / max(1, n)) for part in STEP_PARTS}
        step_parts["other"] = us((sum(times) - prompt_in_steps) / max(1, n)) - sum(step_parts.values())
        return {
            "requests": num_requests,
            "us_per_request": {part: us(total.get(part, 0.0) / num_requests) for part in PARTS},
            "evictions": len(s.get("evict", [])),
            "steps": n,
            "step_us": {"median": us(statistics.median(times)), "mean": us(statistics.fmean(times)),
                        "p99": us(times[min(n - 1, int(0.99 * n))]), "max": us(times[-1])},
            "step_us_per_request": us(sum(times) / num_requests),
            # mean us a step of each part (prompt calls left out: they are us_per_request's)
            "step_parts_us": {k: round(v, 1) for k, v in step_parts.items()},
            "largest_steps": [(us(t), {k: us(v) for k, v in parts.items()}) for t, parts in steps[-4:]],
            "gc_inside": (len(self.gc_inside), round(1e3 * sum(self.gc_inside), 2)),  # (count, ms)
            "gc_outside": (len(self.gc_outside), round(1e3 * sum(self.gc_outside), 2)),
        }


def run(dataset: str = "gsm8k", num_prompts: int = 16, max_tokens: int = 128, k: int = 3,
        batch_size: int = 1, gate: str | float = "auto", stub_forward: bool = False,
        steps_only: bool = False) -> dict:
    """The measured run's report (DrafterClock.report), after the bench's warm-up (bench/offline.py:
    every prompt for one token, then the first batch for WARMUP_MAX_TOKENS). stub_forward: the
    target's arithmetic stubbed, the GPU's step pipeline (bench/stub_target.py; its tokens are
    constant, not the model's)."""
    from foretell import LLM, SamplingParams
    from foretell.bench.datasets import load_prompts
    from foretell.bench.offline import tokenize_prompts
    from foretell.bench.stub_target import stubbed_target
    from foretell.bench.sweep import run_closed_loop
    from foretell.defaults import default_target

    spec = {"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_min_accepted_tokens": gate}
    llm = LLM(default_target(), dtype="float32", num_kv_blocks=1024, max_num_seqs=batch_size,
              num_cpu_threads=1, speculative_config=spec, log_stats_interval_s=0,
              async_scheduling="on" if stub_forward else "auto")
    ids = tokenize_prompts(load_prompts(dataset, num_prompts), llm.engine.tokenizer, chat=False)
    requests = [{"prompt_token_ids": p} for p in ids]

    def params(n):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    with stubbed_target(llm, "constant") if stub_forward else contextlib.nullcontext():
        run_closed_loop(llm, requests, params(1), batch_size)
        run_closed_loop(llm, requests[:batch_size], params(min(WARMUP_MAX_TOKENS, max_tokens)), batch_size)
        clock = DrafterClock(steps_only)
        with clock.installed():
            w0 = time.perf_counter()
            run_closed_loop(llm, requests, params(max_tokens), batch_size)
            wall = time.perf_counter() - w0
    report = clock.report(len(requests))
    report.update(dataset=dataset, k=k, batch_size=batch_size, wall_s=round(wall, 2),
                  mean_prompt_tokens=round(statistics.fmean(len(p) for p in ids), 1),
                  cached_responses=len(llm.engine.runner.proposer.cache),
                  gate_bar=llm.get_stats().get("suffix_gate", {}).get("bar"))
    llm.close()
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="gsm8k")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--stub-forward", action="store_true",
                        help="the target's arithmetic stubbed, the GPU's step pipeline (constant tokens)")
    parser.add_argument("--gate", default="auto", help='the acceptance gate\'s bar: "auto" or a number')
    parser.add_argument("--steps-only", action="store_true",
                        help="time whole propose and forget calls only (no timers nested in a step)")
    args = parser.parse_args(argv)
    gate = args.gate if args.gate == "auto" else float(args.gate)
    r = run(args.dataset, args.num_prompts, args.max_tokens, args.k, args.batch_size, gate, args.stub_forward,
            args.steps_only)
    for key, value in r.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
