"""Engine steps sorted by kind, with the time and tokens of each kind: where a speculative engine's
wall time goes against plain decoding's, step by step.

A step's kind, from the scheduler's decision for it and the step before:
  prefill    some sequence feeds prompt rows (a prefill chunk, a prefix-cache tail)
  drafting   decode rows only, some sequence verifies drafts
  fallback   decode rows only, no drafts, the step before was a drafting one (on a GPU it was not
             queued ahead: the verify before it queued nothing)
  plain      decode rows only, no drafts, after a step of any other kind

For each kind: steps, milliseconds in all and a step, tokens emitted and tokens a millisecond. A
plain engine's run has prefill and plain steps only; the same requests through a drafter's engine
show whether its loss (or gain) lies in its drafting steps (too costly for what they accept), its
fallback steps, or its plain steps (host work a plain engine does not do).

    with StepKinds().install() as kinds:   # Engine.step and Scheduler.schedule wrapped meanwhile
        llm.generate(...)
    kinds.table()                          # {kind: {"steps", "ms", "ms_per_step", "tokens", "tokens_per_ms"}}
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

KINDS = ("prefill", "drafting", "fallback", "plain")


def step_kind(sched, last_kind: str | None) -> str:
    """The kind (module docstring) of a step the scheduler decided as `sched`, after a step of
    last_kind (None: the first)."""
    if any(not item.samples or item.num_new_tokens != 1 + len(item.draft_token_ids) for item in sched.scheduled):
        return "prefill"
    if any(item.draft_token_ids for item in sched.scheduled):
        return "drafting"
    return "fallback" if last_kind == "drafting" else "plain"


class StepKinds:
    """Per kind of engine step: count, seconds and tokens emitted, while installed."""

    def __init__(self) -> None:
        self.steps = dict.fromkeys(KINDS, 0)
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.tokens = dict.fromkeys(KINDS, 0)
        self._last_kind: str | None = None
        self._sched = None  # the SchedulerOutput of the step running now
        self._seen: dict[int, int] = {}  # sequence id -> its output tokens after its last step

    @contextmanager
    def install(self) -> Iterator["StepKinds"]:
        """Engine.step timed and Scheduler.schedule's decision kept, put back on exit."""
        from foretell.engine.engine import Engine
        from foretell.engine.scheduler import Scheduler

        step, schedule = Engine.step, Scheduler.schedule

        def kept_schedule(scheduler, *args, **kwargs):
            self._sched = schedule(scheduler, *args, **kwargs)
            return self._sched

        def timed_step(engine, *args, **kwargs):
            self._sched = None
            start = time.perf_counter()
            outputs = step(engine, *args, **kwargs)
            self._record(time.perf_counter() - start)
            return outputs

        Scheduler.schedule, Engine.step = kept_schedule, timed_step
        try:
            yield self
        finally:
            Scheduler.schedule, Engine.step = schedule, step

    def _record(self, seconds: float) -> None:
        sched = self._sched
        if sched is None or not sched.scheduled:
            return
        kind = step_kind(sched, self._last_kind)
        self._last_kind = kind
        self.steps[kind] += 1
        self.seconds[kind] += seconds
        # Tokens emitted: each sampling sequence's output count now less the one it had after its
        # last step (kept per sequence id: the scheduled item does not hold it).
        self.tokens[kind] += sum(self._new_tokens(item.seq) for item in sched.scheduled if item.samples)

    def _new_tokens(self, seq) -> int:
        now = seq.num_output_tokens
        before = self._seen.get(seq.seq_id, 0)
        self._seen[seq.seq_id] = now
        return now - before

    def table(self) -> dict:
        """{kind: steps, ms, ms_per_step, tokens, tokens_per_ms} for the kinds that ran."""
        rows = {}
        for kind in KINDS:
            steps, ms, tokens = self.steps[kind], 1e3 * self.seconds[kind], self.tokens[kind]
            if steps:
                rows[kind] = {"steps": steps, "ms": round(ms, 3), "ms_per_step": round(ms / steps, 4),
                              "tokens": tokens, "tokens_per_ms": round(tokens / ms, 3) if ms > 0 else None}
        return rows


def format_kinds(rows: dict) -> str:
    """The table() as markdown."""
    lines = ["| step kind | steps | ms | ms a step | tokens | tokens a ms |", "|---|---|---|---|---|---|"]
    lines += [f"| {kind} | {r['steps']} | {r['ms']:.1f} | {r['ms_per_step']:.4f} | {r['tokens']} | "
              f"{r['tokens_per_ms'] if r['tokens_per_ms'] is not None else '-'} |" for kind, r in rows.items()]
    return "\n".join(lines)
