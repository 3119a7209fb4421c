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
engine step, after the step's results are read (the runner's propose_from_tokens, or the host
step's propose), so the time between two of its calls is one whole engine step: Engine.step()'s
period, measured where the drafter sees it. An interval counts when the batch is steady (the same
sequences, all sampling, as the call before: no prefill chunk, no request joining or leaving, no
idle gap between generate() calls). Call i closes step i's results and proposes the drafts of step
i + 1; the interval from call i to call i + 1 holds the drafter's work at call i, the engine's output
processing and schedule, and step i + 1's launch and read back. Where steps are queued ahead
(runner/step_pipeline.py: a GPU), step i's finish queues step i + 1 as a plain step (no drafts)
before reading step i, and a verify with host drafts queues at most the plain step after it, on the
guess that nobody drafts next (runner/host_verify.py). So, by what call i and call i - 1 drafted:
  - drafting (call i drafted): step i + 1 verifies the drafts. When call i - 1 did not draft, a
    plain step i + 1 was queued ahead and is dropped; it still runs on the device before the verify,
    so the interval holds it too. Then the proposal, the verify's launch and its wait;
  - fallback (call i did not draft, call i - 1 did): step i + 1 is a plain step after a verify, queued
    by it where it could be (near a plain step's cost), else launched from the host and waited for
    whole (host work and device latency in a row, not side by side); it queues step i + 2;
  - plain (neither drafted): step i + 1 was queued ahead by step i's finish: the host's work runs
    while the device computes, the interval is a plain step's period (on a GPU with a small
    target, its host work). On a CPU nothing is queued ahead: plain and fallback cost the same.
A run of m drafting intervals (m calls in a row drafted) is followed by one fallback interval, so
drafting costs the m intervals plus the fallback's excess over a plain step, against m + 1 plain
steps: per drafting step t_draft = D + (F - P) / m, D the drafting interval, F the fallback, P the
plain one. With a run of one: a draft pays when its 1 + a tokens plus the fallback's one cost less
than 2 + a plain steps, D + F < (2 + a) P, i.e. a > (D + F - P) / P - 1.
Per batch-size bucket (powers of two) D, F and P are the low COST_QUANTILE-quantile of the last
COST_WINDOW intervals of each kind (one statistic for all three: a ratio of like statistics; a low
quantile of many, because a host's slow steps weigh most on the cheapest, the plain step, and a few
in a row would raise P and let losing drafts through). m is the mean run length over the last
COST_WINDOW runs that ended in a timed fallback (a run counts from its chain's first call when the
batch changed under it). Until a bucket has timed MIN_COST_SAMPLES fallbacks t_draft is D alone.
The bar is t_draft / P - 1, clamped to [MIN_AUTO_BAR, k + 1] (k + 1: no draft of at most k tokens
can pay), from the nearest bucket that has timed D and P (ties: the smaller), AUTO_PRIOR_BAR before.

A workload where every sequence drafts every step never shows a plain step: once a bucket has timed
MIN_COST_SAMPLES drafting steps and lacks plain ones, the drafter drafts nothing for EXPLORE_STEPS
steps (drafts change speed only, never tokens: the first of them times a fallback, the others plain
steps), and tries again after EXPLORE_INTERVAL more drafting steps if the batch changed in between;
a bucket that knows its plain cost but has timed fewer than MIN_COST_SAMPLES fallbacks drafts
nothing for one step after a drafting one (a fallback to time), at most once per EXPLORE_INTERVAL
drafting steps. The other way round, a bar that stops drafting (a bar of k or more) would never time
a drafting step again: a bucket's drafting cost older than DRAFT_STALE_AFTER timed intervals is
dropped (its fallbacks too), so the prior (or a nearer bucket) drafts for a few steps and times it
afresh (a slow first measurement, a machine that got faster). A plain interval is only stored when
timed: its bucket's quantile, the ratio and the bar are worked out when a bar is next read
(begin_step, as_dict), from every interval stored by then (the same bar as working them out at each
interval), so a step the drafter knows to be plain whatever the bar (SuffixProposer.propose_step's
quiet steps: nobody matches or every sequence is paused) is timed without them (quiet_step). A run
of quiet steps of one batch only reads the clock at each (the stamps kept, at most MAX_DEFERRED):
the intervals are timed from the stamps, in order and as each step's call would have timed them,
when anything next reads or changes the costs (begin_step, a quiet step of another batch, as_dict),
so a quiet step costs the clock read and one append. A step whose drafter looks up matches unless
the bar forbids it (SuffixProposer.propose_step's sequences with a match or pending tokens, under a
learned bar of k or more) is stamped the same way (barred_step) while the bar surely stays at or
above min_bar: a run of plain intervals moves the plain cost's quantile by at most two places of the
window each (one value in, one out), so the bar at the window's value that many places up is a floor
(t_draft / t_plain falls as t_plain grows), and the run is also cut before a drafting cost goes
stale. The engine's warm-up (compile-bound steps) teaches nothing: the drafter starts the costs
afresh after it (SuffixProposer.drop_cached_responses).
"""

from __future__ import annotations

import time
from typing import Callable

from foretell.spec_decode.cost_buckets import bucket_of, nearest_bucket
from foretell.spec_decode.suffix_step_costs import BucketCosts

#: The bar before any bucket has timed both kinds of step (the fixed bar's default).
AUTO_PRIOR_BAR = 1.0
#: The lowest bar "auto" sets (a draft that accepts nothing still costs a little).
MIN_AUTO_BAR = 0.1
#: Intervals of each kind a bucket keeps; its cost is their COST_QUANTILE-quantile.
COST_WINDOW = 65
#: The quantile of a bucket's intervals taken as its cost, the same for every kind of step (a ratio
#: of like statistics): a low one, robust to a host's slow steps, which weigh most on the plain step.
COST_QUANTILE = 0.25
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
#: Quiet steps of one batch whose clock stamps wait to be timed (StepCostBar.quiet_step) before they
#: are timed in one go: bounds the stamps kept on a long run of quiet steps.
MAX_DEFERRED = 64


class StepCostBar:
    """The "auto" bar (module docstring). Per engine step: begin_step() at the drafter's call (closes
    the interval since the last call, returns the bar for this batch), explore (draft nothing this
    step?), then end_step(drafted)."""

    def __init__(self, max_bar: float, clock: Callable[[], float] = time.perf_counter):
        if not max_bar >= MIN_AUTO_BAR:
            raise ValueError(f"StepCostBar needs max_bar >= {MIN_AUTO_BAR}, got {max_bar!r}")
        self.max_bar = max_bar
        self.clock = clock
        self.buckets: dict[int, BucketCosts] = {}
        self.bar = AUTO_PRIOR_BAR  # this step's
        self.learned = False  # whether this step's bar comes from timed steps (not the prior)
        self.explore = False  # this step drafts nothing (timing a plain or a fallback step)
        self._explore_left = 0
        self._last_time: float | None = None
        self._last_key: tuple | None = None
        self._drafted: bool | None = None  # what the last call drafted (None: not a steady chain)
        self._drafted_before: bool | None = None  # ... and the call before it
        self._run_length = 0  # drafting intervals timed since this chain's last call without drafts
        self._bars: dict[int, float] = {}  # bucket -> its bar, until a cost changes
        self._any_timed = False  # some bucket has timed both kinds of step
        self._plain_stale = False  # some bucket stored plain intervals since its plain cost (_settle_plain)
        self.num_intervals = 0  # timed intervals, all buckets (the clock of staleness)
        self._batch_size, self._bucket = 0, 0  # the last call's batch size and its bucket
        self._quiet_ids: tuple | None = None  # the batch of the last call, when a quiet step (quiet_step)
        self._stamps: list[float] = []  # clock stamps of its quiet steps after it, not timed yet
        # Steps of that batch whose bar is surely >= _barred_min (None: not known yet).
        self._barred_left: int | None = None
        self._barred_min = 0.0

    def begin_step(self, seq_ids: list | None, samples: list[bool]) -> float:
        """The drafter's call of a step: the interval since the last call becomes a sample when the
        batch is steady; returns the bar for this step (also self.bar), sets self.explore."""
        now = self.clock()
        if self._quiet_ids is not None:
            self._time_stamps()
            self._quiet_ids = self._barred_left = None
        self._begin((tuple(seq_ids), all(samples)) if seq_ids else None, len(samples), now)
        if self._plain_stale:  # plain intervals stored since the last bar: their costs first
            self._settle_plain()
        bucket = self._bucket
        bar = self._bars.get(bucket)
        self.bar = bar if bar is not None else self._bar(bucket)
        self.learned = self._any_timed
        return self.bar

    def quiet_step(self, seq_ids: tuple) -> None:
        """begin_step and end_step(False) of a step that drafts nothing whatever the bar
        (SuffixProposer.propose_step; seq_ids, a tuple: its sequences, all sampling): the interval
        timed and the exploration counted as begin_step does them; the bar is not worked out (bar
        and learned stay the last step's: nothing reads them before the next begin_step, which
        counts every interval timed by then). After a quiet step of the same batch only the clock is
        read: the stamp is timed later (_time_stamps), and explore is not set (nothing reads it)."""
        if seq_ids == self._quiet_ids:
            self._stamp()
            return
        now = self.clock()
        if self._quiet_ids is not None:
            self._time_stamps()
        self._begin((seq_ids, True), len(seq_ids), now)
        self._drafted = False
        self._quiet_ids, self._barred_left = seq_ids, None

    def barred_step(self, seq_ids: tuple, min_bar: float) -> bool:
        """For a step of seq_ids (a tuple, all sampling) that drafts nothing when its bar is at
        least min_bar (> MIN_AUTO_BAR): True when that is sure without working the bar out (the
        batch of the last call, which drafted nothing, and the plain intervals since cannot bring
        the bar below min_bar: module docstring); the step is then stamped as a quiet step (the
        caller ends it: no end_step). False: nothing done, the caller goes on with begin_step."""
        if seq_ids != self._quiet_ids or min_bar <= MIN_AUTO_BAR or self.bar < min_bar:
            return False  # (the last bar worked out below min_bar: not worth proving, the next likely too)
        left = self._barred_left
        if left is None or min_bar != self._barred_min:
            left = self._barred_left = self._barred_run(min_bar)
            self._barred_min = min_bar
        if left <= 0:
            return False
        return self._stamp()

    def stamp_same_batch(self, seq_ids: tuple) -> bool:
        """A step its caller knows drafts nothing (SuffixProposer's skipped calls) stamped as a quiet
        step when seq_ids is the batch of the last call, which drafted nothing; else False."""
        if seq_ids != self._quiet_ids:
            return False
        return self._stamp()

    def _stamp(self) -> bool:
        """A quiet step's clock stamp kept (_time_stamps times it later); one barred step fewer
        left, none when the interval is not positive (a plain cost of 0 s leaves the bar
        unknown). Returns True."""
        now = self.clock()
        stamps = self._stamps
        left = self._barred_left
        if left is not None:
            self._barred_left = left - 1 if now > (stamps[-1] if stamps else self._last_time) else 0
        stamps.append(now)
        if len(stamps) >= MAX_DEFERRED:
            self._time_stamps()
        return True

    def _barred_run(self, min_bar: float) -> int:
        """How many plain intervals of the last call's batch from now on surely leave its bar at
        or above min_bar, with no exploration and no drafting cost going stale (0: none sure)."""
        self._time_stamps()
        if self._plain_stale:
            self._settle_plain()
        if self._explore_left or self._drafted is not False or self._drafted_before or self._last_key is None:
            return 0  # (a drafting call before the last: the next interval is a fallback)
        costs = self.buckets.get(self._bucket)
        if costs is None or costs.ratio is None or costs.draft_s is None or len(costs.plain) < MIN_COST_SAMPLES:
            return 0
        ordered = costs.plain.ordered
        i = int((len(ordered) - 1) * costs.quantile)  # (SlidingQuantile.quantile's index)
        if ordered[0] <= 0:
            return 0
        fresh_left = DRAFT_STALE_AFTER - (self.num_intervals - costs.drafted_at)  # before the drafting cost goes stale
        run = min(MAX_DEFERRED, fresh_left, (len(ordered) - 1 - i) // 2)
        while run > 0 and self._bar_at(costs, ordered[i + 2 * run]) < min_bar:
            run -= 1
        return run

    def _bar_at(self, costs: BucketCosts, plain_s: float) -> float:
        """The bar a bucket's own costs give with plain_s as its plain cost (_bar's clamp)."""
        draft_s = costs.draft_s
        if costs.fallback_s is not None:
            draft_s = draft_s + (costs.fallback_s - plain_s) / costs.run_length
        return min(max(draft_s / plain_s - 1.0, MIN_AUTO_BAR), self.max_bar)

    def _time_stamps(self) -> None:
        """The intervals of the quiet steps whose stamps wait (quiet_step), timed in order as
        each step's own call would have timed them."""
        stamps = self._stamps
        if not stamps:
            return
        self._stamps = []
        key, batch_size = (self._quiet_ids, True), len(self._quiet_ids)
        for now in stamps:
            self._begin(key, batch_size, now)
            self._drafted = False

    def _begin(self, key: tuple | None, batch_size: int, now: float) -> None:
        """A step's call at clock time now, less the bar: the interval since the last call timed (a
        steady batch), the exploration counted (self.explore)."""
        if batch_size != self._batch_size:
            self._batch_size, self._bucket = batch_size, bucket_of(batch_size)
        bucket = self._bucket
        steady = key is not None and key[1] and key == self._last_key and self._drafted is not None
        if steady:
            drafted, seconds = self._drafted, now - self._last_time
            if drafted:
                self._run_length += 1
                self._record(bucket, seconds, True)
            elif self._drafted_before is False:
                self._record_plain(bucket, seconds)
            elif self._drafted_before:  # the step that falls back from the run's last verify
                self._record_fallback(bucket, seconds, self._run_length)
            if not drafted:
                self._run_length = 0
        else:
            self._drafted = None  # a new chain: the next interval has no step before it
            self._run_length = 0
        self._drafted_before = self._drafted
        self._last_time, self._last_key = now, key
        if self._explore_left == 0 and steady:
            costs = self.buckets.get(bucket)
            if costs is not None and costs.draft_s is not None and (
                    len(costs.plain) < MIN_COST_SAMPLES or (costs.fallback_s is None and self._drafted)):
                self._explore_left = self._exploration(costs, self._drafted)  # (else it answers 0)
        self.explore = self._explore_left > 0
        if self.explore:
            self._explore_left -= 1

    def restart(self) -> None:
        """Forget every cost (after the engine's warm-up: its steps compile kernels)."""
        self.__init__(self.max_bar, self.clock)

    def end_step(self, drafted: bool) -> None:
        """What this step's call drafted (any sequence)."""
        key = self._last_key
        self._drafted = drafted if key is not None else None
        if not drafted and key is not None and key[1]:  # the batch's next quiet step only stamps the clock
            self._quiet_ids, self._barred_left = key[0], None

    def _record(self, bucket: int, seconds: float, drafted: bool) -> None:
        if not drafted:
            self._record_plain(bucket, seconds)
            return
        costs = self.buckets.get(bucket)
        if costs is None:
            costs = self.buckets[bucket] = BucketCosts(COST_WINDOW, COST_QUANTILE, MIN_COST_SAMPLES)
        before = costs.ratio
        self.num_intervals += 1
        costs.drafted_at = self.num_intervals
        costs.add(seconds, True)
        self._changed(costs, before)

    def _record_plain(self, bucket: int, seconds: float) -> None:
        """A plain interval, stored only (its bucket's plain_s and ratio wait for the next bar:
        _settle_plain)."""
        costs = self.buckets.get(bucket)
        if costs is None:
            costs = self.buckets[bucket] = BucketCosts(COST_WINDOW, COST_QUANTILE, MIN_COST_SAMPLES)
        self.num_intervals += 1
        if costs.draft_s is not None and self.num_intervals - costs.drafted_at > DRAFT_STALE_AFTER:
            before = costs.ratio
            costs.forget_drafting()  # stale: drafting is timed again (module docstring)
            self._changed(costs, before)
        costs.plain.append(seconds)  # (costs.add(seconds, False))
        costs.plain_stale = self._plain_stale = True

    def _settle_plain(self) -> None:
        """Every bucket's plain cost from the plain intervals stored since (and the bars, where a
        ratio changed)."""
        self._plain_stale = False
        for costs in self.buckets.values():
            if costs.plain_stale and costs.settle_plain():
                self._ratio_changed(costs)

    def _record_fallback(self, bucket: int, seconds: float, run_length: int) -> None:
        costs = self.buckets.get(bucket)
        if costs is None:  # (a run's drafting intervals made the bucket)
            return
        before = costs.ratio
        self.num_intervals += 1
        costs.add_fallback(seconds, run_length)
        self._changed(costs, before)

    def _changed(self, costs: BucketCosts, ratio_before: float | None) -> None:
        if costs.ratio != ratio_before:
            self._ratio_changed(costs)

    def _ratio_changed(self, costs: BucketCosts) -> None:
        """The bars after a bucket's ratio changed."""
        self._bars.clear()
        self._any_timed = costs.ratio is not None or any(c.ratio is not None for c in self.buckets.values())

    def _exploration(self, costs: BucketCosts, last_drafted: bool) -> int:
        """Steps to draft nothing from this call on (module docstring), for a bucket that has timed
        drafting: EXPLORE_STEPS when it has timed no plain steps, 1 when it lacks fallbacks and the
        last call drafted (the next interval is a fallback), else 0; at most once per
        EXPLORE_INTERVAL drafting intervals."""
        if len(costs.plain) < MIN_COST_SAMPLES:  # (no plain_s yet, settled or not)
            steps = EXPLORE_STEPS
        elif costs.fallback_s is None and last_drafted:
            steps = 1
        else:
            return 0
        if costs.explored_at is not None and costs.num_draft - costs.explored_at < EXPLORE_INTERVAL:
            return 0
        costs.explored_at = costs.num_draft
        return steps

    def _bar(self, bucket: int) -> float:
        """The bar of a bucket (a power of two), kept in _bars until a cost changes."""
        bar = self._bars.get(bucket)
        if bar is None:
            own = self.buckets.get(bucket)
            if own is not None and own.ratio is not None:  # timed itself: the nearest bucket
                ratio = own.ratio
            elif not self._any_timed:
                ratio = None
            else:
                timed = [b for b, costs in self.buckets.items() if costs.ratio is not None]
                ratio = self.buckets[nearest_bucket(timed, bucket)].ratio
            bar = AUTO_PRIOR_BAR if ratio is None else min(max(ratio - 1.0, MIN_AUTO_BAR), self.max_bar)
            self._bars[bucket] = bar
        return bar

    def as_dict(self) -> dict:
        """For get_stats(): the bar now, and per bucket (named by its smallest batch) the step costs
        in ms (None: not timed yet): a drafting step's as charged (t_draft: its interval and its
        share of the fallback's excess), the fallback step's, the plain step's; the drafting
        intervals per fallback (m), and the bar they give ("bar": the last call's batch's, from
        every interval timed so far: what begin_step returned, or would have after a quiet_step)."""
        self._time_stamps()
        if self._plain_stale:
            self._settle_plain()
        sizes = sorted(self.buckets)
        bar = self._bar(self._bucket) if self._batch_size else self.bar

        def ms(seconds):
            return None if seconds is None else round(1e3 * seconds, 4)

        return {
            "auto": True,
            "bar": round(bar, 4),
            "batch_sizes": sizes,
            "draft_step_ms": [ms(self.buckets[b].charged_draft_s) for b in sizes],
            "fallback_step_ms": [ms(self.buckets[b].fallback_s) for b in sizes],
            "plain_step_ms": [ms(self.buckets[b].plain_s) for b in sizes],
            "steps_per_fallback": [round(self.buckets[b].run_length, 2) for b in sizes],
            "bars": [round(self._bar(b), 4) for b in sizes],
        }
