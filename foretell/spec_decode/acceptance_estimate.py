"""Per-position acceptance of drafts, as adaptive speculation (spec_decode/adaptive.py) estimates it.

AcceptanceEstimate keeps, for each draft position 1..K, counts of the verifies that reached its
draft and of those that accepted it, and gives the conditional rate
P(draft j accepted | drafts 1..j-1 accepted) from them plus a prior worth PRIOR_WEIGHT observations
(CHAIN_PRIOR_WEIGHT after the first position). A position's counts fade (FADE_PER_STEP) in the
steps that reach it, so its memory is its last ~33 steps of evidence, and a position nobody drafts
keeps what it knew instead of drifting back to an optimistic prior within a few dozen steps (which
made the policy probe on its own every ~15 steps at batch 1): its counts weigh half as much for
every EVIDENCE_HALF_LIFE steps since it was last reached, so the estimate returns to its prior
slowly. The prior of position j + 1 is position j's estimate (conditional rates along a chain are
about flat), PRIOR_RATE only for the first: when acceptance rises at the positions drafted, the
estimates of those beyond follow as their own evidence ages.

For exploration it also gives each position's aged evidence and an optimistic rate (an upper
confidence bound, UCB_WIDTH / sqrt(evidence) above the estimate). Pure Python, no torch.
"""

from __future__ import annotations

from math import sqrt
from typing import Sequence

#: Each step that reaches a position multiplies its evidence by this (about a 33-step memory).
FADE_PER_STEP = 0.97
#: The prior conditional acceptance rate of the first position, and how many observations it weighs.
PRIOR_RATE = 0.75
PRIOR_WEIGHT = 0.5
#: How many observations the prior of a later position (the estimate before it) weighs: more than
#: PRIOR_WEIGHT, as it comes from evidence (one unlucky draft at position 4 does not rule k = 4 out).
CHAIN_PRIOR_WEIGHT = 2.0
#: Observations of a position below which an exploration may draft it to learn its rate.
ACCEPT_EVIDENCE = 4.0
#: Steps since a position was last reached over which its counts come to weigh half as much.
EVIDENCE_HALF_LIFE = 128
#: The upper confidence bound of a rate with n observations: the estimate + UCB_WIDTH / sqrt(n + prior).
UCB_WIDTH = 0.5


class AcceptanceEstimate:
    """Per-position conditional acceptance rates from fading counts of tried and accepted drafts."""

    def __init__(self, max_k: int, fade: float = FADE_PER_STEP, prior_rate: float = PRIOR_RATE,
                 prior_weight: float = PRIOR_WEIGHT, chain_prior_weight: float = CHAIN_PRIOR_WEIGHT):
        if max_k < 1:
            raise ValueError(f"AcceptanceEstimate needs max_k >= 1, got {max_k}")
        if not 0 < fade <= 1 or not 0 <= prior_rate <= 1 or prior_weight <= 0 or chain_prior_weight <= 0:
            raise ValueError(
                f"AcceptanceEstimate needs 0 < fade <= 1, 0 <= prior_rate <= 1, prior_weight > 0 and "
                f"chain_prior_weight > 0; got {fade}, {prior_rate}, {prior_weight}, {chain_prior_weight}"
            )
        self.max_k = max_k
        self.fade = fade
        self.prior_rate = prior_rate
        self.prior_weights = [prior_weight] + [chain_prior_weight] * (max_k - 1)  # [K]
        self._tried = [0.0] * max_k  # position j: verifies that reached draft j (faded)
        self._accepted = [0.0] * max_k  # ... and accepted it
        self.num_steps = 0  # end_step() calls: the clock of the evidence's age
        self.last_reached = [0] * max_k  # position j: the step it was last tried in
        # This step's verifies not yet added to the counts, as two histograms (observe() runs for
        # every sequence of every step: two increments, the counts are summed once a step).
        self._exactly = [0] * (max_k + 1)  # index a: verifies that accepted exactly a drafts
        self._rejected_at = [0] * max_k  # index a: ... of them that had a draft a + 1 and rejected it
        self._pending = False
        self._reached = 0  # positions tried since the last end_step()

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """One sequence's verify: num_drafted drafts (those it could accept), num_accepted taken."""
        if num_drafted <= 0:
            return
        if num_drafted > self.max_k:
            num_drafted = self.max_k
        if num_accepted > num_drafted:
            num_accepted = num_drafted
        self._exactly[num_accepted] += 1
        if num_accepted < num_drafted:  # the first rejected position was tried too
            self._rejected_at[num_accepted] += 1
        self._pending = True

    def _add_pending(self) -> None:
        """Add the verifies observed since the last call to the counts."""
        if not self._pending:
            return
        exactly, rejected = self._exactly, self._rejected_at
        passed = 0  # verifies that accepted more than j drafts
        for j in range(self.max_k - 1, -1, -1):
            passed += exactly[j + 1]
            tried = passed + rejected[j]
            if tried:
                self._tried[j] += tried
                self._accepted[j] += passed
                self._reached = max(self._reached, j + 1)
        self._exactly = [0] * (self.max_k + 1)
        self._rejected_at = [0] * self.max_k
        self._pending = False

    @property
    def tried(self) -> list[float]:
        """[K]: per position, the (faded) verifies that reached its draft."""
        self._add_pending()
        return self._tried

    @property
    def accepted(self) -> list[float]:
        """[K]: per position, the (faded) verifies that accepted its draft."""
        self._add_pending()
        return self._accepted

    def end_step(self) -> None:
        """One engine step passed: the evidence of the positions it reached fades."""
        self._add_pending()
        self.num_steps += 1
        f = self.fade
        for j in range(self._reached):
            self._tried[j] *= f
            self._accepted[j] *= f
            self.last_reached[j] = self.num_steps
        self._reached = 0

    def _ageing(self) -> list[float]:
        """[K]: the weight of each position's counts, halved for every EVIDENCE_HALF_LIFE steps
        since it was last reached (1 for a position reached every step)."""
        now = self.num_steps
        return [1.0 if seen == now else 0.5 ** ((now - seen) / EVIDENCE_HALF_LIFE) for seen in self.last_reached]

    def rates(self) -> list[float]:
        """Conditional acceptance rate at each position 1..K: its aged counts and a prior, the
        estimate of the position before (PRIOR_RATE for the first)."""
        prior, out = self.prior_rate, []
        for a, t, age, w in zip(self.accepted, self.tried, self._ageing(), self.prior_weights):
            prior = (a * age + w * prior) / (t * age + w)
            out.append(prior)
        return out

    def evidence(self) -> list[float]:
        """[K]: each position's aged observations (what exploration trusts)."""
        return [t * age for t, age in zip(self.tried, self._ageing())]

    def optimistic_rates(self, rates: Sequence[float] | None = None) -> list[float]:
        """[K]: an upper confidence bound of each position's rate (module docstring)."""
        rates = self.rates() if rates is None else rates
        return [min(1.0, r + UCB_WIDTH / sqrt(n + w)) for r, n, w in zip(rates, self.evidence(), self.prior_weights)]

    def first_uncertain_position(self) -> int:
        """The first position (0-based) with less than ACCEPT_EVIDENCE evidence; K when none."""
        return next((j for j, n in enumerate(self.evidence()) if n < ACCEPT_EVIDENCE), self.max_k)

    def expected_tokens(self, rates: Sequence[float] | None = None) -> list[float]:
        """[K + 1]: expected tokens a sequence gets from a step that drafts k (index k)."""
        rates = self.rates() if rates is None else rates
        out, reach = [1.0], 1.0
        for r in rates:
            reach *= r
            out.append(out[-1] + reach)
        return out
