"""Adaptive speculation: how many tokens to draft for the next step, chosen per step for the batch.

speculative_config {"num_speculative_tokens": "auto"} or {"adaptive": true,
"num_speculative_tokens": K} turns it on (config.py). Each engine step the scheduler asks
AdaptiveDraftLength.choose(batch_size) for k in 0..K, the drafts the proposer makes for the next
step (k = 0: a plain decode step; a draft LM still catches up on the accepted tokens, an EAGLE3
or MTP head runs not at all under adaptive_skip_catch_up, config.py), and
reports every verify back through observe(). The choice maximizes expected tokens per second,

    k* = argmax_k  E[tokens per sequence step | k] / T(batch, k)

E from running per-position acceptance estimates (AcceptanceEstimate: the conditional rate at
each position, P(draft j accepted | drafts 1..j-1 accepted)), E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i;
T from a StepCosts: in the engine, engine/step_costs.py's LearnedStepCosts, seeded on CUDA with
timed replays of the graphs at start-up (runner/startup_costs.py) and learned from the engine's
own timed steps (record_step(): the wall time of every step, kept when the step was steady: every
sequence sampled and verified k drafts and the choice before was k too); in tests, a fixed
StepCostModel. With seeded costs nothing needs timing, so exploration only looks for acceptance.

Acceptance: spec_decode/acceptance_estimate.py (fading per-position counts and a prior, with the
evidence and optimistic rates exploration reads). With a drafter that skips its catch-up at k = 0
(holes_after_zero), the verifies of the first IGNORED_AFTER_ZERO drafting choices after a k = 0
are not observed: the head drafts them over a KV cache with holes at the skipped positions and
accepts far less than it will once drafting runs on (docs/perf-log.md); counted, those probes
would pull the estimate down at exactly the batch sizes that chose k = 0, and hold adaptive there.

Exploration is separate from the choice and scheduled (per batch bucket, a power of two): it looks
for something to learn after EXPLORE_EVERY steps, then after gaps that double up to
EXPLORE_MAX_GAP, so its share of steps falls as the run goes on. At a look it holds one k
(a switch step, then the steady steps the cost model needs, or none when only acceptance is
missing: the switch step's drafts are verified in the next one) when that k
  - lacks knowledge: its cost at this batch is not converged (StepCosts.needs_timing: untimed,
    too few or too scattered samples, or stale), or a position it drafts has little evidence
    (AcceptanceEstimate.first_uncertain_position), and
  - might win: its optimistic rate, with optimistic acceptance (AcceptanceEstimate's upper
    confidence bound per position) over optimistic cost (the cost model's lower bound), beats the
    best k's estimated rate.
A k that cannot beat the best even at its best possible acceptance and cost is never explored.

Pure Python, no torch: tests drive it with a fake cost model and fake acceptance.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from typing import Protocol, Sequence

from foretell.spec_decode.acceptance_estimate import AcceptanceEstimate

#: The K that num_speculative_tokens "auto" stands for (adaptive, 0..K drafts per step).
ADAPTIVE_DEFAULT_MAX_K = 4
#: The largest K adaptive speculation takes: every k in 0..K has its cost learned at each batch size.
ADAPTIVE_LARGEST_MAX_K = 8
#: Decisions kept for inspection (get_stats shows their histogram over the whole run).
RECENT_CHOICES = 256
#: Steps (at a batch bucket) before its first look for something to explore; each exploration
#: doubles the gap to the next look, up to EXPLORE_MAX_GAP.
EXPLORE_EVERY = 8
EXPLORE_MAX_GAP = 256
#: Drafting choices after a k = 0 whose verifies the estimate does not observe (holes_after_zero).
IGNORED_AFTER_ZERO = 8


class StepCosts(Protocol):
    """T(batch, k): seconds of one engine step at a batch size where each sequence verifies k drafts."""

    @property
    def max_k(self) -> int: ...

    def step_seconds(self, batch_size: int, k: int) -> float: ...

    def seconds_by_k(self, batch_size: int) -> Sequence[float]:
        """[K + 1]: step_seconds(batch_size, k) for every k."""
        ...

    def optimistic_seconds_by_k(self, batch_size: int) -> Sequence[float]:
        """[K + 1]: a lower bound of each k's step seconds (what exploration hopes for)."""
        ...

    def record(self, batch_size: int, k: int, seconds: float) -> None:
        """A steady step's wall time (batch_size sequences verified k drafts and drafted k)."""
        ...

    def needs_timing(self, batch_size: int) -> list[int]:
        """The k whose cost at this batch size a timed step would teach (ascending)."""
        ...

    def steady_steps_to_learn(self, batch_size: int, k: int) -> int:
        """Steady steps of k at this batch an exploration holds to keep one time (0: none needed)."""
        ...

    def as_dict(self) -> dict: ...


@dataclass(frozen=True)
class StepCostModel:
    """A fixed StepCosts: seconds of one engine step by batch size and draft length, given at a few
    batch sizes; linear in the batch between them, per sequence constant past the largest. It
    learns nothing from timed steps (tests fix the costs with it)."""

    batch_sizes: tuple[int, ...]  # ascending, each >= 1
    seconds: tuple[tuple[float, ...], ...]  # [len(batch_sizes)][K + 1]: a step drafting k at that batch

    def __post_init__(self) -> None:
        sizes = self.batch_sizes
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"StepCostModel batch_sizes must be distinct ascending integers >= 1, got {sizes}")
        if len(self.seconds) != len(sizes):
            raise ValueError(
                f"StepCostModel needs one row of seconds per batch size: {len(sizes)} sizes, "
                f"{len(self.seconds)} rows"
            )
        widths = {len(row) for row in self.seconds}
        if len(widths) != 1 or widths.pop() < 2:
            raise ValueError("StepCostModel rows must all hold K + 1 >= 2 step times (k = 0..K)")
        if any(not s > 0 for row in self.seconds for s in row):
            raise ValueError(f"StepCostModel step times must be > 0 seconds, got {self.seconds}")

    @property
    def max_k(self) -> int:
        return len(self.seconds[0]) - 1

    def step_seconds(self, batch_size: int, k: int) -> float:
        sizes, rows = self.batch_sizes, self.seconds
        i = bisect_left(sizes, batch_size)
        if i < len(sizes) and sizes[i] == batch_size:
            return rows[i][k]
        if i == 0:  # below the smallest measured batch: no cheaper than it
            return rows[0][k]
        if i == len(sizes):  # past the largest: the per-sequence cost of the largest
            return rows[-1][k] * batch_size / sizes[-1]
        lo, hi = sizes[i - 1], sizes[i]
        t = (batch_size - lo) / (hi - lo)
        return rows[i - 1][k] * (1 - t) + rows[i][k] * t

    def seconds_by_k(self, batch_size: int) -> list[float]:
        return [self.step_seconds(batch_size, k) for k in range(self.max_k + 1)]

    def optimistic_seconds_by_k(self, batch_size: int) -> list[float]:
        return self.seconds_by_k(batch_size)  # known exactly

    def record(self, batch_size: int, k: int, seconds: float) -> None:
        pass

    def needs_timing(self, batch_size: int) -> list[int]:
        return []

    def steady_steps_to_learn(self, batch_size: int, k: int) -> int:
        return 0

    def as_dict(self) -> dict:
        return {"learned": False, "batch_sizes": list(self.batch_sizes),
                "step_ms": [[round(1000 * s, 4) for s in row] for row in self.seconds]}


@dataclass
class _ExploreSchedule:
    """When a batch bucket next looks for something to explore."""

    gap: int = EXPLORE_EVERY  # steps between two looks; doubles with each exploration
    steps: int = 0  # steps at this bucket since the last look
    explorations: int = 0


class AdaptiveDraftLength:
    """The scheduler's draft-length policy under adaptive speculation (a DraftLength: choose,
    observe), which the engine also tells each step's wall time (record_step)."""

    def __init__(self, costs: StepCosts, estimate: AcceptanceEstimate | None = None, holes_after_zero: bool = False):
        self.costs = costs
        self.holes_after_zero = holes_after_zero  # k = 0 runs no drafter: its cache has holes after one
        self.max_k = costs.max_k
        self.estimate = estimate or AcceptanceEstimate(self.max_k)
        if self.estimate.max_k != self.max_k:
            raise ValueError(
                f"the acceptance estimate covers {self.estimate.max_k} positions, the cost model "
                f"k = 0..{self.max_k}"
            )
        self.chosen_histogram = [0] * (self.max_k + 1)  # index k: steps that chose k
        self.recent = deque(maxlen=RECENT_CHOICES)
        self.last = self.max_k
        # The step being run: the sequences that sample in it (0: none, or no choice made) and the
        # drafts each verifies (the choice before); record_step() reads them.
        self.step_batch = 0
        self.step_verifies = self.max_k
        self.schedules: dict[int, _ExploreSchedule] = {}  # batch bucket (bit length) -> its looks
        self.exploring_k: int | None = None
        self.exploring_bucket = 0
        self.exploring_steps_left = 0
        self.num_explorations = 0
        self.num_exploring_steps = 0  # steps whose choice an exploration held
        self.num_timed_steps = 0  # steady steps handed to the cost model
        self.drafting_since_zero: int | None = None  # drafting choices since the last k = 0 (None: none yet)
        self.num_ignored_observations = 0  # verifies not observed (holes_after_zero)

    def rates(self, batch_size: int) -> list[float]:
        """[K + 1]: expected tokens per second of a sequence at this batch size, by k."""
        return [e / t for e, t in zip(self.estimate.expected_tokens(), self.costs.seconds_by_k(batch_size))]

    def best(self, batch_size: int) -> int:
        """The k with the most expected tokens per second at this batch size (ties: the smaller)."""
        return self._argmax(self.rates(batch_size))

    @staticmethod
    def _argmax(rates: Sequence[float]) -> int:
        best_k, best_rate = 0, -1.0
        for k, rate in enumerate(rates):
            if rate > best_rate * (1 + 1e-9):
                best_k, best_rate = k, rate
        return best_k

    def choose(self, batch_size: int) -> int:
        """Drafts per sequence for the next step; batch_size = the sequences the coming steps are
        expected to run (the scheduler's running and waiting ones, up to max_num_seqs; 0: none
        samples in this step, nothing is drafted, the last choice stands)."""
        if batch_size <= 0:
            self.step_batch = 0
            return self.last
        self.estimate.end_step()
        self.step_batch, self.step_verifies = batch_size, self.last
        k = self._explore(batch_size)
        if k is None:
            k = self.best(batch_size)
        self.chosen_histogram[k] += 1
        self.recent.append(k)
        self.last = k
        if k == 0:
            self.drafting_since_zero = 0
        elif self.drafting_since_zero is not None:
            self.drafting_since_zero += 1
        return k

    def _explore(self, batch_size: int) -> int | None:
        """The k an exploration holds now, or None (module docstring)."""
        bucket = batch_size.bit_length()
        if self.exploring_steps_left > 0 and bucket == self.exploring_bucket:
            self.exploring_steps_left -= 1
            self.num_exploring_steps += 1
            return self.exploring_k
        self.exploring_steps_left = 0
        schedule = self.schedules.get(bucket)
        if schedule is None:
            schedule = self.schedules[bucket] = _ExploreSchedule()
        schedule.steps += 1
        if schedule.steps < schedule.gap:
            return None
        schedule.steps = 0  # looked now: the next look after the gap
        k = self.exploration_candidate(batch_size)
        if k is None:
            return None
        schedule.gap = min(2 * schedule.gap, EXPLORE_MAX_GAP)
        schedule.explorations += 1
        self.num_explorations += 1
        self.num_exploring_steps += 1
        self.exploring_k, self.exploring_bucket = k, bucket
        self.exploring_steps_left = self.costs.steady_steps_to_learn(batch_size, k)
        return k

    def exploration_candidate(self, batch_size: int) -> int | None:
        """The k worth exploring now at this batch size (module docstring), or None."""
        estimate, costs = self.estimate, self.costs
        rates = estimate.rates()
        point = [e / t for e, t in zip(estimate.expected_tokens(rates), costs.seconds_by_k(batch_size))]
        best_k = self._argmax(point)
        hopes = [e / t for e, t in zip(estimate.expected_tokens(estimate.optimistic_rates(rates)),
                                       costs.optimistic_seconds_by_k(batch_size))]
        uncertain_from = estimate.first_uncertain_position()
        untimed = set(costs.needs_timing(batch_size))
        found = [k for k in range(self.max_k + 1)
                 if k != best_k and (k in untimed or k > uncertain_from) and hopes[k] > point[best_k]]
        return max(found, key=lambda k: hopes[k]) if found else None

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if (self.holes_after_zero and self.drafting_since_zero is not None
                and self.drafting_since_zero <= IGNORED_AFTER_ZERO):
            self.num_ignored_observations += 1
            return
        self.estimate.observe(num_drafted, num_accepted)

    def record_step(self, seconds: float, num_sequences: int, num_rows: int) -> None:
        """The wall time of the engine step whose choice was the last one, with the sequences it
        ran and their rows (drafts included). Passed on to the cost model when the step was
        steady: each sequence sampled and verified k drafts, and k was chosen again."""
        batch, k = self.step_batch, self.last
        if batch and k == self.step_verifies and num_sequences == batch and num_rows == batch * (k + 1):
            self.costs.record(batch, k, seconds)
            self.num_timed_steps += 1

    def stats(self) -> dict:
        steps = sum(self.chosen_histogram)
        return {
            "adaptive_max_k": self.max_k,
            "adaptive_chosen_k_histogram": list(self.chosen_histogram),
            "adaptive_mean_chosen_k": (
                sum(k * n for k, n in enumerate(self.chosen_histogram)) / steps if steps else 0.0
            ),
            "adaptive_acceptance_estimate": [round(r, 4) for r in self.estimate.rates()],
            "adaptive_step_costs": self.costs.as_dict(),
            "adaptive_timed_steps": self.num_timed_steps,
            "adaptive_explorations": self.num_explorations,
            "adaptive_exploring_steps": self.num_exploring_steps,
            "adaptive_ignored_observations": self.num_ignored_observations,
        }
