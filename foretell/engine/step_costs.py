"""Step costs for adaptive speculation, learned from the engine's own steps and, on CUDA with
graphs, seeded at start-up from timed graph replays: what one engine step costs by batch size and
by the number of drafts k each sequence verifies (0..K), the T(batch, k) of
spec_decode/adaptive.py's choice.

Start-up (runner/startup_costs.py): on CUDA with captured graphs, the verify graph of each batch
bucket and k + 1 rows and the draft loop's graph for k are replayed a few times under CUDA events
(the start-up estimate at Llama-8B size: docs/perf-log.md, "step costs seeded from graph replays"),
and each (bucket, k) cell gets their sum as its prior. Whole dummy steps are not timed (far too slow
a start-up on a CPU: docs/perf-log.md, sixteenth GPU session); without graphs (the CPU, eager mode,
tensor parallelism) nothing is measured and the cells start empty. A replay holds no host work: in a
seeded bucket every k costs its prior plus the bucket's offset, the lower median of (timed - prior)
over the bucket's last OFFSET_WINDOW kept steps, whatever k they ran (the nearest seeded bucket's
when it has none, 0 before any step). One offset for every k, from the steps just run, keeps the k
comparable as contexts grow through a run: a cell's own times would date from when that k last ran
(at batch 256 on the H200 a k = 0 cell kept from early short contexts looked cheaper than a k = 1
cell timed later, and the policy flapped between them, below both fixed choices; docs/perf-log.md,
issue 28, 2026-12-02). A seeded cell never needs timing: exploration only looks for acceptance.

The engine times each of its steps: wall clock around Engine.step(), which ends after the step's
results were read back, so timing adds no device sync. The policy passes on the steady ones (every
scheduled sequence samples and verifies k drafts, and the choice before was k too: a step right
after a switch verifies the old k and drafts the new one), and they land here in a cell per
(batch bucket, k). Buckets are powers of two: batch 1, 2-3, 4-7, 8-15, ... (a bucket is named by
its smallest batch).

A cell's cost is the lower median of its last COST_WINDOW steps (robust to a slow spell of a shared
machine, and it follows contexts that grow; a stale cell's old steps are forgotten when it is
timed again); its first steady step is dropped, since the first run
of a shape may compile kernels. The cells not timed yet are estimated, as the cost of a step is
about linear in k (k + 1 verify rows, k draft passes): with two or more k timed in the bucket,
piecewise linear through them (extrapolated with the slope of the nearest two, never falling with
k); with one, that cost times the relative costs of the nearest bucket that timed two or more (else
of the prior profile 1 + PRIOR_COST_PER_DRAFT * k); a bucket with nothing timed borrows the
nearest one's curve.

A cell's cost has converged when CONVERGED_SAMPLES kept steps agree within CONVERGED_SPREAD (or its
window is full); until then, or once stale, the policy may time it again when it might compete
(AdaptiveDraftLength's exploration), judging by optimistic_seconds_by_k: a converged cell's cost,
an unconverged one's fastest step less TIMED_SLACK, an untimed one's estimate less UNTIMED_SLACK
but never below what a timed smaller k costs (a draft never makes a step cheaper); a seeded
cell's cost as it stands.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Mapping, Sequence

from foretell.spec_decode.adaptive import AdaptiveDraftLength
from foretell.spec_decode.cost_buckets import bucket_of, lower_median, nearest_bucket

logger = logging.getLogger("foretell")

#: Steady steps a cell keeps; its cost is their lower median.
COST_WINDOW = 5
#: Relative cost of each draft before any bucket has timed two k: a step drafting k costs
#: 1 + PRIOR_COST_PER_DRAFT * k plain steps (cheap drafts: the policy starts high and learns).
PRIOR_COST_PER_DRAFT = 0.1
#: A cell untouched for this many steady steps (of any cell) is timed again.
STALE_AFTER_STEPS = 2048
#: A cell's cost has converged with this many kept steps within CONVERGED_SPREAD of their fastest.
CONVERGED_SAMPLES = 2
CONVERGED_SPREAD = 0.05
#: How much cheaper than its fastest kept step an unconverged (or stale) cell might be.
TIMED_SLACK = 0.05
#: How much cheaper than its estimate an untimed cell might be.
UNTIMED_SLACK = 0.2
#: Kept steps of a seeded bucket (any k) whose gaps to their priors give the bucket's offset.
OFFSET_WINDOW = 8
#: Extrapolating down in k never gives less than this share of the nearest timed cost.
MIN_EXTRAPOLATED_SHARE = 0.1


class _Cell:
    """One (batch bucket, k): its last steady step times."""

    __slots__ = ("samples", "seen", "last_tick", "seconds", "prior")

    def __init__(self, prior: float | None = None):
        self.samples: deque[float] = deque(maxlen=COST_WINDOW)
        self.seen = False  # the first steady step (dropped) has passed
        self.last_tick = 0
        self.seconds: float | None = None  # the lower median of samples; None until one is kept
        self.prior = prior  # the start-up replays' seconds (device time only); None: not seeded

    def add(self, seconds: float, tick: int) -> bool:
        """Keep a steady step's time; returns whether the cell's cost changed."""
        self.last_tick = tick
        if not self.seen:
            self.seen = True
            return False
        self.samples.append(seconds)
        old, self.seconds = self.seconds, lower_median(self.samples)
        return self.seconds != old

    def converged(self) -> bool:
        """Enough kept steps that agree (or a full window): timing it again teaches little."""
        n = len(self.samples)
        if n >= COST_WINDOW:
            return True
        return n >= CONVERGED_SAMPLES and max(self.samples) <= (1 + CONVERGED_SPREAD) * min(self.samples)


class LearnedStepCosts:
    """A StepCosts (spec_decode/adaptive.py) learned from timed engine steps (module docstring)."""

    def __init__(self, max_k: int, stale_after_steps: int = STALE_AFTER_STEPS,
                 priors: Mapping[int, Sequence[float]] | None = None):
        """priors: {batch size: [K + 1] seconds by k}, the start-up replays' (runner/startup_costs.py)."""
        if max_k < 1:
            raise ValueError(f"LearnedStepCosts needs max_k >= 1, got {max_k}")
        if stale_after_steps < 1:
            raise ValueError(f"LearnedStepCosts needs stale_after_steps >= 1, got {stale_after_steps}")
        self._max_k = max_k
        self.stale_after_steps = stale_after_steps
        self.buckets: dict[int, list[_Cell]] = {}  # bucket (its smallest batch) -> [K + 1] cells
        self.num_steps = 0  # steady steps recorded (the clock of staleness)
        self._curves: dict[int, list[float]] = {}  # bucket -> step_seconds by k, until a cost it uses changes
        self._borrowing: set[int] = set()  # seeded buckets whose curve took another bucket's host offset
        # Seeded bucket -> (timed - prior) of its last OFFSET_WINDOW kept steps, any k.
        self._gaps: dict[int, deque[float]] = {}
        self._num_timed: dict[int, int] = {}  # bucket -> how many of its k have a cost
        self.seeded: set[int] = set()  # buckets whose cells have priors
        self.startup_seconds = 0.0  # what measuring the priors took (set by start_adaptive_speculation)
        for batch_size, seconds in (priors or {}).items():
            self._seed(batch_size, seconds)

    @property
    def max_k(self) -> int:
        return self._max_k

    def _seed(self, batch_size: int, seconds: Sequence[float]) -> None:
        """Give batch_size's bucket a prior per k (seconds by k, K + 1 of them)."""
        if batch_size < 1 or len(seconds) != self._max_k + 1 or not all(s > 0 for s in seconds):
            raise ValueError(
                f"a step-cost prior needs batch_size >= 1 and {self._max_k + 1} seconds > 0 (k = 0..{self._max_k}); "
                f"got batch_size {batch_size}, seconds {list(seconds)}"
            )
        bucket = self.bucket_of(batch_size)
        self.buckets[bucket] = [_Cell(prior=float(s)) for s in seconds]
        self.seeded.add(bucket)
        self._curves.clear()

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        """The power of two at or below batch_size: the smallest batch of its bucket."""
        return bucket_of(batch_size)

    def record(self, batch_size: int, k: int, seconds: float) -> None:
        """A steady step: batch_size sequences verified k drafts each and drafted k, in seconds."""
        if not 0 <= k <= self._max_k or batch_size < 1 or not seconds > 0:
            raise ValueError(
                f"a timed step needs batch_size >= 1, k in 0..{self._max_k} and seconds > 0; "
                f"got {batch_size}, {k}, {seconds}"
            )
        self.num_steps += 1
        bucket = self.bucket_of(batch_size)
        cells = self.buckets.get(bucket)
        if cells is None:
            cells = self.buckets[bucket] = [_Cell() for _ in range(self._max_k + 1)]
        was_timed = cells[k].seconds is not None
        if was_timed and cells[k].last_tick < self.num_steps - self.stale_after_steps:
            cells[k].samples.clear()  # stale: the new step alone says what the cell costs now
        kept = cells[k].seen  # the cell's first steady step is dropped (add() says why)
        changed = cells[k].add(seconds, self.num_steps)
        if kept and cells[k].prior is not None:
            self._gaps.setdefault(bucket, deque(maxlen=OFFSET_WINDOW)).append(seconds - cells[k].prior)
            changed = True  # the bucket's offset moved: its curve and its borrowers' are recomputed
        if changed:
            if not was_timed:
                self._num_timed[bucket] = self._num_timed.get(bucket, 0) + 1
            # This bucket's curve, and those of buckets that borrow (fewer than two k timed; seeded:
            # a host offset from another bucket).
            self._curves = {b: c for b, c in self._curves.items() if b != bucket and b not in self._borrowing
                            and (b in self.seeded or self._num_timed.get(b, 0) >= 2)}

    def needs_timing(self, batch_size: int) -> list[int]:
        """The k whose cost at this batch has not converged, or has no kept step for
        STALE_AFTER_STEPS steady steps."""
        cells = self.buckets.get(self.bucket_of(batch_size))
        if cells is None:
            return list(range(self._max_k + 1))
        return [k for k, cell in enumerate(cells) if not self._known(cell)]

    def _known(self, cell: _Cell) -> bool:
        if cell.prior is not None:  # seeded: what steps add refines it, nothing needs a timed step
            return True
        return cell.converged() and cell.last_tick >= self.num_steps - self.stale_after_steps

    def steady_steps_to_learn(self, batch_size: int, k: int) -> int:
        """Steady steps of k to hold for one kept time: 0 when the cell is known, 2 while its
        first steady step (dropped) has not passed, else 1."""
        cells = self.buckets.get(self.bucket_of(batch_size))
        if cells is None:
            return 2
        cell = cells[k]
        if self._known(cell):
            return 0
        return 1 if cell.seen else 2

    def optimistic_seconds_by_k(self, batch_size: int) -> list[float]:
        """[K + 1]: a lower bound of each k's cost at this batch (module docstring)."""
        estimate = self.seconds_by_k(batch_size)
        cells = self.buckets.get(self.bucket_of(batch_size))
        if cells is None:
            return [s * (1 - UNTIMED_SLACK) for s in estimate]
        out, floor = [], 0.0  # floor: the least a timed smaller k might cost
        for k, cell in enumerate(cells):
            if cell.prior is not None:  # seeded: its cost as it stands
                out.append(estimate[k])
                continue
            if cell.seconds is None:
                out.append(max(estimate[k] * (1 - UNTIMED_SLACK), floor))
                continue
            least = min(cell.samples) * (1 - TIMED_SLACK)
            out.append(cell.seconds if self._known(cell) else least)
            floor = max(floor, least)
        return out

    def step_seconds(self, batch_size: int, k: int) -> float:
        """T(batch, k): the cell's own cost when timed, else an estimate (module docstring)."""
        return self.seconds_by_k(batch_size)[k]

    def seconds_by_k(self, batch_size: int) -> list[float]:
        """[K + 1]: step_seconds(batch_size, k) for every k (the caller must not change it)."""
        bucket = self.bucket_of(batch_size)
        curve = self._curves.get(bucket)
        # Computed once per bucket until a cost it uses changes (seeded: its offset moves).
        if curve is None:
            curve = self._curves[bucket] = self._curve(bucket)
        return curve

    def _timed(self, bucket: int) -> list[tuple[int, float]]:
        return [(k, cell.seconds) for k, cell in enumerate(self.buckets[bucket]) if cell.seconds is not None]

    def _nearest(self, bucket: int, min_timed: int, exclude: int | None = None) -> int | None:
        """The bucket nearest to `bucket` (itself included; ties: the smaller batch) with at least
        min_timed timed cells, other than `exclude`."""
        found = [b for b, n in self._num_timed.items() if b != exclude and n >= min_timed]
        if not found:
            return None
        return nearest_bucket(found, bucket)

    def _curve(self, bucket: int) -> list[float]:
        """[K + 1] seconds by k at this bucket: timed cells and estimates."""
        if bucket in self.seeded:
            return self._seeded_curve(bucket)
        if self._num_timed.get(bucket, 0) >= 2:  # the common case, once a bucket has run a while
            return self._piecewise_linear(self._timed(bucket))
        prior = [1.0 + PRIOR_COST_PER_DRAFT * k for k in range(self._max_k + 1)]
        source = self._nearest(bucket, 1)
        if source is None:  # nothing timed anywhere yet: only the relative costs matter
            return prior
        timed = self._timed(source)
        if len(timed) >= 2:
            return self._piecewise_linear(timed)
        ref, ref_seconds = timed[0]
        shaper = self._nearest(source, 2, exclude=source)
        shape = self._piecewise_linear(self._timed(shaper)) if shaper is not None else prior
        return [ref_seconds * shape[k] / shape[ref] for k in range(self._max_k + 1)]

    def _seeded_curve(self, bucket: int) -> list[float]:
        """[K + 1]: a seeded bucket's priors plus its offset (module docstring)."""
        offset, source = self._host_offset(bucket)
        if source == bucket:
            self._borrowing.discard(bucket)
        else:
            self._borrowing.add(bucket)
        return [max(cell.prior + offset, MIN_EXTRAPOLATED_SHARE * cell.prior) for cell in self.buckets[bucket]]

    def _host_offset(self, bucket: int) -> tuple[float, int | None]:
        """(offset, the bucket it came from): the lower median of the bucket's recent gaps (timed -
        prior: the host work a replay does not hold, and the contexts' growth since the replays);
        without any, the nearest seeded bucket's (ties: the smaller batch); 0 (None) before any
        seeded bucket kept a step."""
        source = bucket
        if not self._gaps.get(bucket):
            others = [b for b in self.seeded if b != bucket and self._gaps.get(b)]
            if not others:
                return 0.0, None
            source = nearest_bucket(others, bucket)
        return lower_median(self._gaps[source]), source

    def _piecewise_linear(self, timed: list[tuple[int, float]]) -> list[float]:
        """[K + 1]: through the timed (k, seconds), ascending in k, two at least; outside them the
        slope of the nearest two, made >= 0 (a draft never makes a step cheaper)."""
        curve = [0.0] * (self._max_k + 1)
        for (k0, s0), (k1, s1) in zip(timed, timed[1:]):
            slope = (s1 - s0) / (k1 - k0)
            for k in range(k0, k1 + 1):
                curve[k] = s0 + slope * (k - k0)
        (k0, s0), (k1, s1) = timed[0], timed[1]
        down = max((s1 - s0) / (k1 - k0), 0.0)
        for k in range(k0):
            curve[k] = max(s0 - down * (k0 - k), MIN_EXTRAPOLATED_SHARE * s0)
        (k0, s0), (k1, s1) = timed[-2], timed[-1]
        up = max((s1 - s0) / (k1 - k0), 0.0)
        for k in range(k1 + 1, self._max_k + 1):
            curve[k] = s1 + up * (k - k1)
        return curve

    def as_dict(self) -> dict:
        """For get_stats(): per bucket (named by its smallest batch), each k's cost in ms (None: not
        timed yet, the choice uses an estimate), how many steady steps it kept, and its start-up
        prior in ms (None: not seeded)."""
        sizes = sorted(self.buckets)
        return {
            "learned": True,
            "batch_sizes": sizes,
            "step_ms": [
                [None if c.seconds is None else round(1000 * c.seconds, 4) for c in self.buckets[b]] for b in sizes
            ],
            "timed_steps": [[len(c.samples) for c in self.buckets[b]] for b in sizes],
            "prior_ms": [
                [None if c.prior is None else round(1000 * c.prior, 4) for c in self.buckets[b]] for b in sizes
            ],
            "startup_seconds": round(self.startup_seconds, 3),
            "num_steady_steps": self.num_steps,
        }


def start_adaptive_speculation(engine) -> AdaptiveDraftLength:
    """Hand the scheduler its adaptive draft-length policy. Its step costs are seeded from the
    runner's graph replays where it has captured graphs (RunnerHandle.replay_step_costs), and
    learned as it runs (Engine.step() reports every step's time)."""
    max_k = engine.config.speculative.num_speculative_tokens
    start = time.perf_counter()
    priors = engine.runner.replay_step_costs(max_k)
    costs = LearnedStepCosts(max_k, priors=priors)
    costs.startup_seconds = time.perf_counter() - start
    policy = AdaptiveDraftLength(costs, holes_after_zero=engine.facts.skips_catch_up)
    engine.scheduler.draft_length = policy
    if priors:
        logger.info("adaptive speculation: k = 0..%d, step costs seeded from graph replays at batches %s (%.2f s), "
                    "then learned from the engine's own steps", max_k, sorted(priors), costs.startup_seconds)
    else:
        logger.info("adaptive speculation: k = 0..%d, step costs learned from the engine's own steps", max_k)
    return policy
