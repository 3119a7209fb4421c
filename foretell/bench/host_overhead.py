"""The host's work per engine step, apart from the model's arithmetic (issue 32's small-model path).

On the GPU the device step is queued ahead (runner/step_pipeline.py), so for a small model the
host's work per step IS the step time. On the CPU the same Python runs, and the model's forwards
are the CPU's own arithmetic; this probe times each part of Engine.step on a live engine and takes
the forwards out:

  schedule             Scheduler.schedule
  runner host          Runner.execute less the forwards below (checks, input tensors, sampling,
                       the step pipeline, the drafter's glue)
  target forward       the target model's forward and LM head (the arithmetic the GPU runs)
  drafter forward      the draft modules' forwards (EAGLE3 head, draft LM, MTP layers)
  postprocess          Scheduler.postprocess (tokens appended, stops, block commits)
  output processing    the rest of each sequence's share (detokenizer, stop strings, logprobs,
                       counters, token origins)
  request outputs      RequestOutput building, finished requests, the stats log line
  engine glue          the step's time outside all of the above

host_us = step_us - target forward - drafter forward: what the step would cost with the model's
arithmetic free. Each part is measured in wall time and in this thread's CPU time (steadier on a
machine shared with other processes; with one torch thread the forwards run on this thread too).

  measure_host_overhead(llm, prompts, params, batch_size)  -> HostOverhead (public, tested)
  python -m foretell.bench.host_overhead --method eagle3 --batch-size 16   (default family, GSM8K)

With `stub_forward` (--stub-forward) the target's forward and LM head are a stub (zeros; logits
that pick one token), and on the CPU a plain decode step goes through the target's graph buffers
as on the GPU (an uncaptured runner/cuda_graph.py runner: pack, unpack and "replay" of the stub),
so the table shows the host path the GPU's queued decode steps take, minus the CUDA calls
themselves (events, streams, the unpack kernel's launch, the replay). Tokens are meaningless then.
A host drafter (n-gram, suffix) gets the GPU's pipeline too (graph_setup.build_step_pipeline over
uncaptured graph buffers of host_draft_verify_lens: the padded verify step with HostDraftSlots,
and whatever else that function gives a host drafter), with steps queued ahead; its stub logits
pick the token the sequence's own suffix index would draft (the first continuation of its
longest match), so drafts are accepted as on a repetitive text and the verify path runs.

Every wrapper is an instance attribute set for the measured run and removed afterwards (an
instance attribute that was there before is put back); nothing of the engine's classes or modules
is patched.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from foretell.bench.stub_target import STUB_TOKENS, _StubTarget, stubbed_target  # noqa: F401 (re-exported)

PARTS = (
    "schedule", "runner host", "target forward", "drafter forward", "postprocess",
    "output processing", "request outputs", "engine glue",
)
_FORWARD_METHODS = ("forward", "compute_logits", "compute_greedy_tokens", "step", "combine")
_ABSENT = object()


@dataclass
class HostOverhead:
    """Per engine step (decode / verify steps after the prefill), microseconds."""

    method: str | None  # the drafter, None for plain decoding
    batch_size: int
    num_steps: int
    num_tokens: int  # generated during the measured steps
    wall_us: dict[str, float] = field(default_factory=dict)  # part -> wall us per step
    cpu_us: dict[str, float] = field(default_factory=dict)  # part -> thread CPU us per step
    step_wall_us: float = 0.0
    step_cpu_us: float = 0.0
    # part -> the median over steps of its thread CPU us in one step: on a machine shared with
    # other processes the steadiest figure (a descheduled or cache-cold step moves the mean)
    cpu_us_median: dict[str, float] = field(default_factory=dict)

    @property
    def host_wall_us(self) -> float:
        return self.step_wall_us - self.wall_us["target forward"] - self.wall_us["drafter forward"]

    @property
    def host_cpu_us(self) -> float:
        return self.step_cpu_us - self.cpu_us["target forward"] - self.cpu_us["drafter forward"]

    @property
    def tokens_per_step(self) -> float:
        return self.num_tokens / self.num_steps if self.num_steps else 0.0

    def as_dict(self) -> dict:
        return {
            "method": self.method, "batch_size": self.batch_size, "num_steps": self.num_steps,
            "num_tokens": self.num_tokens, "tokens_per_step": self.tokens_per_step,
            "step_wall_us": self.step_wall_us, "step_cpu_us": self.step_cpu_us,
            "host_wall_us": self.host_wall_us, "host_cpu_us": self.host_cpu_us,
            "wall_us": dict(self.wall_us), "cpu_us": dict(self.cpu_us),
            "cpu_us_median": dict(self.cpu_us_median),
        }

    def table(self) -> str:
        med = self.cpu_us_median
        lines = [f"{'part':<20}{'wall us/step':>14}{'cpu us/step':>13}{'cpu median':>12}"]
        for name in PARTS:
            lines.append(f"{name:<20}{self.wall_us[name]:>14.1f}{self.cpu_us[name]:>13.1f}{med[name]:>12.1f}")
        lines.append(f"{'step (all)':<20}{self.step_wall_us:>14.1f}{self.step_cpu_us:>13.1f}{med['step']:>12.1f}")
        lines.append(f"{'host (no forwards)':<20}{self.host_wall_us:>14.1f}{self.host_cpu_us:>13.1f}"
                     f"{med['host']:>12.1f}")
        return "\n".join(lines)


class _Clock:
    """Wall and thread-CPU nanoseconds summed per part; a part re-entered while running (a
    forward calling another wrapped method of the same part) counts once."""

    def __init__(self) -> None:
        self.wall: dict[str, int] = dict.fromkeys(PARTS + ("step", "apply"), 0)
        self.cpu: dict[str, int] = dict.fromkeys(PARTS + ("step", "apply"), 0)
        self.depth: dict[str, int] = dict.fromkeys(PARTS + ("step", "apply"), 0)
        self.on = False
        self.cpu_per_step: list[dict[str, int]] = []  # each timed step's own CPU ns per part

    def step_done(self, before: dict[str, int]) -> None:
        self.cpu_per_step.append({k: v - before[k] for k, v in self.cpu.items()})

    def wrap(self, part: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on or self.depth[part]:
                return fn(*args, **kwargs)
            self.depth[part] += 1
            w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu[part] += time.thread_time_ns() - c0
                self.wall[part] += time.perf_counter_ns() - w0
                self.depth[part] -= 1

        return timed


@contextlib.contextmanager
def _instrumented(llm, clock: _Clock) -> Iterator[None]:
    from foretell.runner.model_runner import ModelRunner

    engine = llm.engine
    runner = engine.runner
    if not isinstance(runner, ModelRunner):
        raise ValueError(f"the host-overhead probe needs a single-process engine (tensor_parallel_size 1); "
                         f"this engine runs a {type(runner).__name__}")
    targets: list[tuple[Any, str, str]] = [
        (engine, "step", "step"),
        (engine.scheduler, "schedule", "schedule"),
        (runner, "execute", "runner host"),
        (engine, "_apply_result", "apply"),
        (engine.scheduler, "postprocess", "postprocess"),
        (engine, "_finish_step", "request outputs"),
    ]
    for name in _FORWARD_METHODS:
        if hasattr(runner.model, name):
            targets.append((runner.model, name, "target forward"))
    if hasattr(runner.proposer, "_head_step"):  # EAGLE3's head step, also where it skips the modules (the CPU)
        targets.append((runner.proposer, "_head_step", "drafter forward"))
    drafter = runner.proposer.draft_modules() if runner.proposer is not None else []
    for module in drafter:
        for name in _FORWARD_METHODS:
            if hasattr(module, name):
                targets.append((module, name, "drafter forward"))
    saved = [(obj, name, vars(obj).get(name, _ABSENT)) for obj, name, _ in targets]
    for obj, name, part in targets:
        setattr(obj, name, clock.wrap(part, getattr(obj, name)))
    try:
        yield
    finally:
        for obj, name, before in saved:
            if before is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, before)


def _run(engine, prompts: list[list[int]], params, clock: _Clock, prefix: str) -> tuple[int, int]:
    """Add the prompts, run their prefill untimed, then time every step to the end; returns
    (timed steps, tokens generated in them)."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", {"prompt_token_ids": ids}, params)
    counts: dict[str, int] = {}
    while any(seq.num_computed_tokens < seq.num_prompt_tokens
              for request in engine.requests.values() for seq in request.seqs):
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
    start_tokens = sum(counts.values())
    steps = 0
    clock.on = True
    try:
        while engine.has_unfinished_requests():
            before = dict(clock.cpu)
            for out in engine.step():
                counts[out.request_id] = len(out.outputs[0].token_ids)
            clock.step_done(before)
            steps += 1
    finally:
        clock.on = False
    return steps, sum(counts.values()) - start_tokens


def measure_host_overhead(llm, prompts: list[list[int]], params, batch_size: int = 1,
                          warm_up: bool = True, stub_forward: bool = False,
                          stub_tokens: str = "constant", stub_seed: int = 0) -> HostOverhead:
    """Time the engine's steps over `prompts` (token-id lists), `batch_size` of them at a time,
    each to the end of `params` (use ignore_eos and max_tokens for a fixed length). The first
    batch also runs once untimed first (warm-up) unless warm_up is False. stub_forward: the
    target's forward stubbed and plain decode steps on the graph buffers (stubbed_target; its
    tokens: stub_tokens, salted by stub_seed: bench/stub_target._StubTarget)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not prompts:
        raise ValueError("prompts is empty: give at least one token-id prompt")
    engine = llm.engine
    if engine.requests:
        raise ValueError(f"the engine has {len(engine.requests)} requests in flight: measure on an idle engine")
    clock = _Clock()
    steps = tokens = 0
    stub = stubbed_target(llm, stub_tokens, stub_seed) if stub_forward else contextlib.nullcontext()
    with stub, _instrumented(llm, clock):
        if warm_up:
            _run(engine, prompts[:batch_size], params, _Clock(), "host-overhead-warm-up-")
        for start in range(0, len(prompts), batch_size):
            s, t = _run(engine, prompts[start:start + batch_size], params, clock, f"host-overhead-{start}-")
            steps, tokens = steps + s, tokens + t
    spec = engine.config.speculative
    result = HostOverhead(spec.method if spec is not None else None, batch_size, steps, tokens)
    per_step = 1e-3 / max(steps, 1)  # ns -> us, per step
    for totals, out in ((clock.wall, result.wall_us), (clock.cpu, result.cpu_us)):
        out.update({name: ns * per_step for name, ns in _parts(totals).items() if name in PARTS})
    result.step_wall_us = clock.wall["step"] * per_step
    result.step_cpu_us = clock.cpu["step"] * per_step
    samples = [_parts(step) for step in clock.cpu_per_step]
    for name in PARTS + ("step", "host"):
        result.cpu_us_median[name] = statistics.median(s[name] for s in samples) * 1e-3 if samples else 0.0
    return result


def count_step_work(llm, prompts: list[list[int]], params, batch_size: int = 1, stub_forward: bool = False,
                    stub_tokens: str = "constant") -> dict:
    """Per decode / verify step of the same runs measure_host_overhead times (prefills excluded,
    a warm-up batch first): the device->host syncs, device ops and uploads they would make on a
    GPU (bench/device_syncs.DeviceSyncCounter) and the Python function calls (a second run, under
    sys.setprofile, so the counter's own Python is not counted). Counts, not times: the same on
    any machine; never time under them."""
    import sys

    from foretell.bench.device_syncs import DeviceSyncCounter, difference

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    engine = llm.engine
    from collections import Counter

    sites: Counter[str] = Counter()
    totals = {"steps": 0, "syncs": 0, "device_ops": 0, "uploads": 0, "python_calls": 0}

    def run_all(counter: DeviceSyncCounter | None, calls: list[int] | None) -> None:
        def profile(frame, event, arg):
            if event == "call":
                calls[0] += 1

        for start in range(-batch_size, len(prompts), batch_size):  # the first batch: a warm-up
            batch = prompts[max(start, 0):max(start, 0) + batch_size]
            for i, ids in enumerate(batch):
                engine.add_request(f"count-{start}-{i}", {"prompt_token_ids": ids}, params)
            while any(seq.num_computed_tokens < seq.num_prompt_tokens
                      for request in engine.requests.values() for seq in request.seqs):
                engine.step()
            while engine.has_unfinished_requests():
                before = counter.snapshot() if counter is not None else None
                if calls is not None and start >= 0:
                    sys.setprofile(profile)
                try:
                    engine.step()
                finally:
                    sys.setprofile(None)
                if start < 0:
                    continue
                if counter is not None:
                    delta = difference(counter.snapshot(), before)
                    for key in ("syncs", "device_ops", "uploads"):
                        totals[key] += delta[key]
                    sites.update(delta["sites"])
                    totals["steps"] += 1

    stub = stubbed_target(llm, stub_tokens) if stub_forward else contextlib.nullcontext()
    with DeviceSyncCounter() as counter:  # entered first: the stub's graph buffers count as device data
        counter.track_engine(engine.runner)
        with stub:
            run_all(counter, None)
    calls = [0]
    with (stubbed_target(llm, stub_tokens, seed=1) if stub_forward else contextlib.nullcontext()):
        run_all(None, calls)
    totals["python_calls"] = calls[0]
    steps = max(totals["steps"], 1)
    return {"steps": totals["steps"], **{f"{key}_per_step": totals[key] / steps
                                        for key in ("syncs", "device_ops", "uploads", "python_calls")},
            "sync_sites_per_step": {site: n / steps for site, n in sites.most_common()}}


def _parts(totals: dict[str, int]) -> dict[str, int]:
    """The reported parts (and "step", "host") from the wrapped calls' nanoseconds."""
    forwards = totals["target forward"] + totals["drafter forward"]
    parts = {
        "schedule": totals["schedule"], "runner host": totals["runner host"] - forwards,
        "target forward": totals["target forward"], "drafter forward": totals["drafter forward"],
        "postprocess": totals["postprocess"], "output processing": totals["apply"] - totals["postprocess"],
        "request outputs": totals["request outputs"],
    }
    parts["engine glue"] = totals["step"] - sum(parts.values())
    parts["step"] = totals["step"]
    parts["host"] = totals["step"] - forwards
    return parts


def main(argv: list[str] | None = None) -> None:
    """python -m foretell.bench.host_overhead [--method eagle3] [--batch-size 1] ...: the shipped
    default family (Qwen3 layout) on GSM8K prompts; prints the table, optionally writes JSON."""
    import argparse
    import json

    from foretell import LLM, SamplingParams
    from foretell.bench.datasets import load_prompts

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--method", default="none",
                        help="none, or a drafter of the default family (eagle3, draft_model, ngram, suffix)")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=0, help="default: the batch size")
    parser.add_argument("--dataset", default="gsm8k", help="a prompt set of foretell bench (gsm8k, repetitive, ...)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-cpu-threads", type=int, default=1)
    parser.add_argument("--async-scheduling", default="on", choices=["auto", "on", "off"])
    parser.add_argument("--stub-forward", action="store_true",
                        help="the target's forward stubbed; decode (and a host drafter's verify) steps on the graph "
                             "buffers, queued ahead (the GPU's host path)")
    parser.add_argument("--stub-tokens", default="constant", choices=STUB_TOKENS,
                        help="with --stub-forward: constant (one token: a host drafter's drafts all accepted) or "
                             "fresh (never repeats: a host drafter finds nothing)")
    parser.add_argument("--count", action="store_true",
                        help="also count syncs, device ops, uploads and Python calls per step (count_step_work)")
    parser.add_argument("--repeat", type=int, default=1, help="measure this many times (medians side by side)")
    parser.add_argument("--output-json")
    args = parser.parse_args(argv)
    method = None if args.method == "none" else args.method
    llm = LLM.default("qwen3", method, num_speculative_tokens=args.num_speculative_tokens if method else None,
                      device=args.device, num_cpu_threads=args.num_cpu_threads, log_stats_interval_s=0,
                      async_scheduling=args.async_scheduling)
    count = args.num_prompts or args.batch_size
    prompts = [llm.tokenizer.encode(p.text) for p in load_prompts(args.dataset, count, seed=0)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results = []
    stubbed = f" (stubbed forward, {args.stub_tokens} tokens)" if args.stub_forward else ""
    for run in range(args.repeat):
        result = measure_host_overhead(llm, prompts, params, batch_size=args.batch_size,
                                       stub_forward=args.stub_forward, stub_tokens=args.stub_tokens,
                                       stub_seed=run + 2)
        print(f"method {args.method}, batch {args.batch_size}, {result.num_steps} steps, "
              f"{result.tokens_per_step:.2f} tokens a step{stubbed}")
        print(result.table())
        print(f"host cpu median us per token: {result.cpu_us_median['host'] / max(result.tokens_per_step, 1e-9):.1f}")
        results.append(result)
    if args.repeat > 1:
        print("cpu medians per run: " + "; ".join(
            f"{name} " + " ".join(f"{r.cpu_us_median[name]:.0f}" for r in results)
            for name in PARTS + ("host",) if name not in ("target forward", "drafter forward")))
    counts = None
    if args.count:
        counts = count_step_work(llm, prompts, params, args.batch_size, args.stub_forward, args.stub_tokens)
        print(f"per step ({counts['steps']} steps): syncs {counts['syncs_per_step']:.2f}, device ops "
              f"{counts['device_ops_per_step']:.1f}, uploads {counts['uploads_per_step']:.2f}, Python calls "
              f"{counts['python_calls_per_step']:.0f}")
        for site, n in counts["sync_sites_per_step"].items():
            print(f"  sync {n:.2f}/step {site}")
    if args.output_json:
        rows = [r.as_dict() for r in results] if args.repeat > 1 else results[0].as_dict()
        with open(args.output_json, "w") as f:
            json.dump(rows if counts is None else {"timing": rows, "counts": counts}, f, indent=1)


if __name__ == "__main__":
    main()
