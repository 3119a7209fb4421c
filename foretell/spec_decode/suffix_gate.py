"""The acceptance gate's bar under suffix_decoding_min_accepted_tokens = "auto": what a sequence's
drafts must accept on average to keep drafting follows what a drafting step costs on this machine
against a plain decode step, learned from the engine's own steps.

Why: a step that verifies drafts yields 1 + accepted tokens, a plain step 1; a drafting step costing
r plain steps pays when accepted > r - 1. r differs by machine and model: on a CPU the forward
dominates and a verify of a few rows costs little more than one row (r near 1); on a GPU with a
small target a plain step is queued ahead on the device and costs only its host work, while a
drafting step waits for its results, proposes on the host and launches a verify (r several times
larger; the figures are in docs/perf-log.md). A fixed bar is too low on one and too high on the other.

How it is timed, without a device sync or a start-up measurement: the drafter is called once per
engine step (after the step's results are read), so the time between two of its calls is one whole
engine step (the drafter's own work, the scheduler, the runner's launch and read back, the output
processing): Engine.step()'s period, measured where the drafter sees it. An interval counts when the
batch is steady (the same sequences, all sampling, as the call before: no prefill chunk, no request
joining or leaving, no idle gap between generate() calls) and is classified by what the first call
drafted: a drafting step (the call drafted for any sequence: the interval holds the proposal and the
verify) or a plain one (neither that call nor the one before drafted: the interval holds a plain
step queued ahead, not the step that falls back from a verify). Per batch-size bucket (powers of two)
the lower median of the last COST_WINDOW intervals of each kind is its cost; the bar is
t_draft / t_plain - 1, clamped to [MIN_AUTO_BAR, k + 1] (k + 1: no draft of at most k tokens can pay),
taken from the nearest bucket that has timed both (ties: the smaller), AUTO_PRIOR_BAR before any has.

A workload where every sequence drafts every step never shows a plain step: once a bucket has timed
MIN_COST_SAMPLES drafting steps and lacks plain ones, the drafter drafts nothing for EXPLORE_STEPS
steps (drafts change speed only, never tokens), and tries again after EXPLORE_INTERVAL more
drafting steps if the batch changed in between. The other way round, a bar that stops drafting
(a bar of k or more) would never time a drafting step again: a bucket's drafting cost older than
DRAFT_STALE_AFTER timed intervals is dropped, so the prior (or a nearer bucket) drafts for a few
steps and times it afresh (a slow first measurement, a machine that got faster). The engine's
warm-up (compile-bound steps) teaches nothing: the drafter starts the costs afresh after it
(SuffixProposer.drop_cached_responses).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from foretell.spec_decode.cost_buckets import bucket_of, lower_median, nearest_bucket

#: The bar before any bucket has timed both kinds of step (the fixed bar's default).
AUTO_PRIOR_BAR = 1.0
#: The lowest bar "auto" sets (a draft that accepts nothing still costs a little).
MIN_AUTO_BAR = 0.1
#: Intervals of each kind a bucket keeps; its cost is their lower median.
COST_WINDOW = 9
#: Intervals of each kind a bucket needs before its bar is used.
MIN_COST_SAMPLES = 3
#: Steps drafted for nobody to time plain steps where none came by themselves (3 steady intervals).
EXPLORE_STEPS = 4
#: Drafting steps between two explorations of a bucket that still lacks plain steps.
EXPLORE_INTERVAL = 64
#: Timed intervals (any kind, any bucket) after which a bucket's drafting cost is timed again.
DRAFT_STALE_AFTER = 4096
#: Under "auto" the gate's longest pause is at least this many tokens per unit of bar: a failed
#: probe costs about `bar` plain steps more than a plain step, so probes that keep failing cost at
#: most ~1 / PAUSE_PER_BAR of the paused tokens' time.
PAUSE_PER_BAR = 16


class _BucketCosts:
    """One batch-size bucket's recent drafting and plain step seconds."""

    __slots__ = ("draft", "plain", "draft_s", "plain_s", "num_draft", "explored_at", "drafted_at")

    def __init__(self):
        self.draft: deque[float] = deque(maxlen=COST_WINDOW)
        self.plain: deque[float] = deque(maxlen=COST_WINDOW)
        self.draft_s: float | None = None  # lower medians, None until MIN_COST_SAMPLES
        self.plain_s: float | None = None
        self.num_draft = 0  # drafting intervals recorded in all
        self.explored_at: int | None = None  # num_draft at the last exploration
        self.drafted_at = 0  # StepCostBar.num_intervals at the last drafting interval

    def add(self, seconds: float, drafted: bool) -> None:
        self.num_draft += drafted
        samples = self.draft if drafted else self.plain
        samples.append(seconds)
        if len(samples) >= MIN_COST_SAMPLES:
            median = lower_median(samples)
            if drafted:
                self.draft_s = median
            else:
                self.plain_s = median

    @property
    def ratio(self) -> float | None:
        """t_draft / t_plain, None until both are known."""
        if self.draft_s is None or self.plain_s is None:
            return None
        return self.draft_s / self.plain_s


class StepCostBar:
    """The "auto" bar (module docstring). Per engine step: begin_step() at the drafter's call (closes
    the interval since the last call, returns the bar for this batch), explore (draft nothing this
    step?), then end_step(drafted)."""

    def __init__(self, max_bar: float, clock: Callable[[], float] = time.perf_counter):
        if not max_bar >= MIN_AUTO_BAR:
            raise ValueError(f"StepCostBar needs max_bar >= {MIN_AUTO_BAR}, got {max_bar!r}")
        self.max_bar = max_bar
        self.clock = clock
        self.buckets: dict[int, _BucketCosts] = {}
        self.bar = AUTO_PRIOR_BAR  # this step's
        self.learned = False  # whether this step's bar comes from timed steps (not the prior)
        self.explore = False  # this step drafts nothing (timing a plain step)
        self._explore_left = 0
        self._last_time: float | None = None
        self._last_key: tuple | None = None
        self._drafted: bool | None = None  # what the last call drafted (None: not a steady chain)
        self._drafted_before: bool | None = None  # ... and the call before it
        self._bars: dict[int, float] = {}  # bucket -> its bar, until a cost changes
        self._any_timed = False  # some bucket has timed both kinds of step
        self.num_intervals = 0  # timed intervals, all buckets (the clock of staleness)

    def begin_step(self, seq_ids: list | None, samples: list[bool]) -> float:
        """The drafter's call of a step: the interval since the last call becomes a sample when the
        batch is steady; returns the bar for this step (also self.bar), sets self.explore."""
        now = self.clock()
        key = (tuple(seq_ids), all(samples)) if seq_ids else None
        batch_size = len(samples)
        steady = key is not None and key[1] and key == self._last_key and self._drafted is not None
        if steady:
            drafted = self._drafted
            if drafted or self._drafted_before is False:
                self._record(batch_size, now - self._last_time, drafted)
        else:
            self._drafted = None  # a new chain: the next interval has no step before it
        self._drafted_before = self._drafted
        self._last_time, self._last_key = now, key
        self.bar = self._bar(batch_size)
        self.learned = self._any_timed
        self.explore = self._explore_left > 0 or (steady and self._should_explore(batch_size))
        if self.explore:
            self._explore_left = (self._explore_left or EXPLORE_STEPS) - 1
        return self.bar

    def restart(self) -> None:
        """Forget every cost (after the engine's warm-up: its steps compile kernels)."""
        self.__init__(self.max_bar, self.clock)

    def end_step(self, drafted: bool) -> None:
        """What this step's call drafted (any sequence)."""
        self._drafted = drafted if self._last_key is not None else None

    def _record(self, batch_size: int, seconds: float, drafted: bool) -> None:
        bucket = bucket_of(batch_size)
        costs = self.buckets.get(bucket)
        if costs is None:
            costs = self.buckets[bucket] = _BucketCosts()
        before = costs.ratio
        self.num_intervals += 1
        if drafted:
            costs.drafted_at = self.num_intervals
        elif costs.draft_s is not None and self.num_intervals - costs.drafted_at > DRAFT_STALE_AFTER:
            costs.draft.clear()  # stale: drafting is timed again (module docstring)
            costs.draft_s = None
        costs.add(seconds, drafted)
        if costs.ratio != before:
            self._bars.clear()
            self._any_timed = any(c.ratio is not None for c in self.buckets.values())

    def _should_explore(self, batch_size: int) -> bool:
        costs = self.buckets.get(bucket_of(batch_size))
        if costs is None or costs.draft_s is None or costs.plain_s is not None:
            return False
        if costs.explored_at is not None and costs.num_draft - costs.explored_at < EXPLORE_INTERVAL:
            return False
        costs.explored_at = costs.num_draft
        return True

    def _bar(self, batch_size: int) -> float:
        bucket = bucket_of(batch_size)
        bar = self._bars.get(bucket)
        if bar is None:
            timed = [b for b, costs in self.buckets.items() if costs.ratio is not None]
            if not timed:
                bar = AUTO_PRIOR_BAR
            else:
                nearest = nearest_bucket(timed, bucket)
                bar = min(max(self.buckets[nearest].ratio - 1.0, MIN_AUTO_BAR), self.max_bar)
            self._bars[bucket] = bar
        return bar

    def as_dict(self) -> dict:
        """For get_stats(): the bar now, and per bucket (named by its smallest batch) the drafting
        and plain step costs in ms (None: not timed yet) and the bar they give."""
        sizes = sorted(self.buckets)

        def ms(seconds):
            return None if seconds is None else round(1e3 * seconds, 4)

        return {
            "auto": True,
            "bar": round(self.bar, 4),
            "batch_sizes": sizes,
            "draft_step_ms": [ms(self.buckets[b].draft_s) for b in sizes],
            "plain_step_ms": [ms(self.buckets[b].plain_s) for b in sizes],
            "bars": [round(self._bar(b), 4) for b in sizes],
        }
