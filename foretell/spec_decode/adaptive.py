"""Adaptive speculation: how many tokens to draft for the next step, chosen per step for the batch.

speculative_config {"num_speculative_tokens": "auto"} or {"adaptive": true,
"num_speculative_tokens": K} turns it on (config.py). Each engine step the scheduler asks
AdaptiveDraftLength.choose(batch_size) for k in 0..K, the drafts the proposer makes for the next
step (k = 0: a plain decode step; the drafter still catches up on the accepted tokens), and
reports every verify back through observe(). The choice maximizes expected tokens per second,

    k* = argmax_k  E[tokens per sequence step | k] / T(batch, k)

E from running per-position acceptance estimates (AcceptanceEstimate: the conditional rate at
each position, P(draft j accepted | drafts 1..j-1 accepted)), E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i;
T from a StepCosts: in the engine, engine/step_costs.py's LearnedStepCosts, learned from the
engine's own timed steps (record_step(): the wall time of every step, kept when the step was
steady: every sequence sampled and verified k drafts and the choice before was k too); in tests,
a fixed StepCostModel.

Estimates are counts that fade each step (FADE_PER_STEP) plus a prior worth PRIOR_WEIGHT
observations. A position nobody drafts (the choice stays below it) keeps no evidence for long: its
estimate drifts back to the prior, which is optimistic, so the policy tries it again (a probe)
after a while; a probe that fails adds its observations and pushes it down again. Probes thus come
by themselves, less often when a step is costly: a probe at batch 256 adds 256 observations and
is not repeated for about 150 steps; at batch 1 with nothing accepted, every 15 steps or so.

Costs are explored too: every EXPLORE_EVERY steps, when the cost model lacks a k at this batch (not
timed yet, or stale) whose expected tokens per second, as estimated, come within EXPLORE_WITHIN
of the best k's, the policy holds that k for EXPLORE_STEPS steps (a switch, a first steady step
a cost model may drop, a kept one). A k that cannot compete is not timed until it might.

Pure Python, no torch: tests drive it with a fake cost model and fake acceptance.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from typing import Protocol, Sequence

#: The K that num_speculative_tokens "auto" stands for (adaptive, 0..K drafts per step).
ADAPTIVE_DEFAULT_MAX_K = 4
#: The largest K adaptive speculation takes: every k in 0..K has its cost learned at each batch size.
ADAPTIVE_LARGEST_MAX_K = 8
#: Each step multiplies every position's evidence by this (about a 33-step memory).
FADE_PER_STEP = 0.97
#: The prior conditional acceptance rate, and how many observations it weighs.
PRIOR_RATE = 0.75
PRIOR_WEIGHT = 0.5
#: Decisions kept for inspection (get_stats shows their histogram over the whole run).
RECENT_CHOICES = 256
#: Steps between two explorations of a k whose cost is not known at the batch size.
EXPLORE_EVERY = 8
#: Steps an exploration holds its k.
EXPLORE_STEPS = 3
#: A k is explored when its estimated tokens per second are at least this share of the best k's.
EXPLORE_WITHIN = 0.75


class AcceptanceEstimate:
    """Per-position conditional acceptance rates from fading counts of tried and accepted drafts."""

    def __init__(self, max_k: int, fade: float = FADE_PER_STEP, prior_rate: float = PRIOR_RATE,
                 prior_weight: float = PRIOR_WEIGHT):
        if max_k < 1:
            raise ValueError(f"AcceptanceEstimate needs max_k >= 1, got {max_k}")
        if not 0 < fade <= 1 or not 0 <= prior_rate <= 1 or prior_weight <= 0:
            raise ValueError(
                f"AcceptanceEstimate needs 0 < fade <= 1, 0 <= prior_rate <= 1 and prior_weight > 0; "
                f"got {fade}, {prior_rate}, {prior_weight}"
            )
        self.max_k = max_k
        self.fade = fade
        self.prior_rate = prior_rate
        self.prior_weight = prior_weight
        self.tried = [0.0] * max_k  # position j: verifies that reached draft j (faded)
        self.accepted = [0.0] * max_k  # ... and accepted it

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """One sequence's verify: num_drafted drafts (those it could accept), num_accepted taken."""
        if num_drafted <= 0:
            return
        num_drafted = min(num_drafted, self.max_k)
        num_accepted = min(num_accepted, num_drafted)
        for j in range(num_accepted):
            self.tried[j] += 1.0
            self.accepted[j] += 1.0
        if num_accepted < num_drafted:  # the first rejected position was tried too
            self.tried[num_accepted] += 1.0

    def end_step(self) -> None:
        """One engine step passed: every position's evidence fades."""
        f = self.fade
        self.tried = [t * f for t in self.tried]
        self.accepted = [a * f for a in self.accepted]

    def rates(self) -> list[float]:
        """Conditional acceptance rate at each position 1..K."""
        w, p = self.prior_weight, self.prior_rate
        return [(a + w * p) / (t + w) for a, t in zip(self.accepted, self.tried)]

    def expected_tokens(self, rates: Sequence[float] | None = None) -> list[float]:
        """[K + 1]: expected tokens a sequence gets from a step that drafts k (index k)."""
        rates = self.rates() if rates is None else rates
        out, reach = [1.0], 1.0
        for r in rates:
            reach *= r
            out.append(out[-1] + reach)
        return out


class StepCosts(Protocol):
    """T(batch, k): seconds of one engine step at a batch size where each sequence verifies k drafts."""

    @property
    def max_k(self) -> int: ...

    def step_seconds(self, batch_size: int, k: int) -> float: ...

    def seconds_by_k(self, batch_size: int) -> Sequence[float]:
        """[K + 1]: step_seconds(batch_size, k) for every k."""
        ...

    def record(self, batch_size: int, k: int, seconds: float) -> None:
        """A steady step's wall time (batch_size sequences verified k drafts and drafted k)."""
        ...

    def needs_timing(self, batch_size: int) -> list[int]:
        """The k whose cost at this batch size a timed step would teach (ascending)."""
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

    def record(self, batch_size: int, k: int, seconds: float) -> None:
        pass

    def needs_timing(self, batch_size: int) -> list[int]:
        return []

    def as_dict(self) -> dict:
        return {"learned": False, "batch_sizes": list(self.batch_sizes),
                "step_ms": [[round(1000 * s, 4) for s in row] for row in self.seconds]}


class AdaptiveDraftLength:
    """The scheduler's draft-length policy under adaptive speculation (a DraftLength: choose,
    observe), which the engine also tells each step's wall time (record_step)."""

    def __init__(self, costs: StepCosts, estimate: AcceptanceEstimate | None = None):
        self.costs = costs
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
        self.exploring_k: int | None = None
        self.exploring_steps_left = 0
        self.steps_since_exploration = 0
        self.num_explorations = 0
        self.num_timed_steps = 0  # steady steps handed to the cost model

    def rates(self, batch_size: int) -> list[float]:
        """[K + 1]: expected tokens per second of a sequence at this batch size, by k."""
        return [e / t for e, t in zip(self.estimate.expected_tokens(), self.costs.seconds_by_k(batch_size))]

    def best(self, batch_size: int) -> int:
        """The k with the most expected tokens per second at this batch size (ties: the smaller)."""
        best_k, best_rate = 0, -1.0
        for k, rate in enumerate(self.rates(batch_size)):
            if rate > best_rate * (1 + 1e-9):
                best_k, best_rate = k, rate
        return best_k

    def choose(self, batch_size: int) -> int:
        """Drafts per sequence for the next step; batch_size = the sequences that sample in this
        one (0: none samples, nothing is drafted; the last choice stands)."""
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
        return k

    def _explore(self, batch_size: int) -> int | None:
        """The k an exploration holds now, or None (module docstring)."""
        if self.exploring_steps_left > 0:
            self.exploring_steps_left -= 1
            return self.exploring_k
        self.steps_since_exploration += 1
        if self.steps_since_exploration < EXPLORE_EVERY:
            return None
        self.steps_since_exploration = 0  # looked now: next look in EXPLORE_EVERY steps
        wanted = self.costs.needs_timing(batch_size)
        if not wanted:
            return None
        rates = self.rates(batch_size)
        k = max(wanted, key=lambda j: rates[j])  # the most promising (ties: the smaller)
        if rates[k] < EXPLORE_WITHIN * max(rates):
            return None
        self.num_explorations += 1
        self.exploring_k, self.exploring_steps_left = k, EXPLORE_STEPS - 1
        return k

    def observe(self, num_drafted: int, num_accepted: int) -> None:
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
        }
