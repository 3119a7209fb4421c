"""Adaptive speculation's exploration (spec_decode/adaptive.py) on a simulated engine: true step
costs (with timing noise) that the policy learns through LearnedStepCosts, and Bernoulli acceptance
at a conditional rate per position. Throughput is scored against the best fixed k computed from the
true model (expected tokens over true seconds), independently of the policy's own estimates.

What it shows: after warm-up, the share of steps an exploration holds falls below a few percent
and throughput stays within 2% of the best fixed k; the policy still finds the new best k when
acceptance or costs change; a k that cannot win even at perfect acceptance is not explored once
its cost is known; and the H200 run of issue 28 (a 128-token run after a warm-up run of the same
shape) reaches the 0.97 bar in the simulation."""

from __future__ import annotations

import pytest

from foretell.engine.step_costs import LearnedStepCosts
from foretell.spec_decode.acceptance_estimate import AcceptanceEstimate
from foretell.spec_decode.adaptive import (
    EXPLORE_MAX_GAP,
    AdaptiveDraftLength,
)
from tests.fixtures.adaptive_sim import SimulatedEngine, expected_tokens


def best_fixed_k(batch: int, rates: list[float], true_ms, max_k: int = 4) -> int:
    return max(range(max_k + 1), key=lambda k: expected_tokens(rates, k) / true_ms(batch, k))


def linear_costs(batch: int, k: int) -> float:
    """ms of a step: a base, verify rows growing with the batch, a draft pass per draft."""
    return 4.0 + 0.02 * batch * (k + 1) + 0.45 * k + 0.004 * batch * k


@pytest.mark.parametrize("batch, rate", [(1, 0.79), (1, 0.36), (1, 0.0), (16, 0.79), (64, 0.36), (256, 0.79)])
def test_exploration_share_falls_after_warm_up(batch, rate):
    policy = AdaptiveDraftLength(LearnedStepCosts(4))
    engine = SimulatedEngine(policy, seed=batch)
    rates = [rate] * 4
    warm = engine.run(batch, rates, linear_costs, 200)
    assert policy.num_explorations >= 1  # it did look around while learning
    late = engine.run(batch, rates, linear_costs, 1200)
    assert late["exploring_share"] < 0.02, late["exploring_share"]
    assert late["efficiency"] > 0.98, (late["efficiency"], warm["efficiency"])
    # Near ties aside, the steps run a k within 2% of the best fixed k's rate.
    rate_of = [expected_tokens(rates, k) / linear_costs(batch, k) for k in range(5)]
    good = [k for k in range(5) if rate_of[k] >= 0.98 * max(rate_of)]
    assert sum(k in good for k in late["chosen"][-200:]) >= 190


def test_the_new_best_is_found_when_acceptance_changes():
    policy = AdaptiveDraftLength(LearnedStepCosts(4))
    engine = SimulatedEngine(policy, seed=7)
    high, none = [0.9] * 4, [0.0] * 4
    assert engine.run(4, high, linear_costs, 150)["chosen"][-30:].count(4) >= 28
    dropped = engine.run(4, none, linear_costs, 100)["chosen"]
    assert dropped[-25:].count(0) >= 20  # the drafted positions tell (their memory: ~33 steps)
    # Back up: position 1 is explored (its evidence ages), the later positions' estimates follow it.
    risen = engine.run(4, high, linear_costs, 700)
    first_four = risen["chosen"].index(4)
    assert first_four < 500, first_four
    assert risen["chosen"][-50:].count(4) >= 48


def test_the_new_best_is_found_when_costs_change():
    policy = AdaptiveDraftLength(LearnedStepCosts(4, stale_after_steps=300))
    engine = SimulatedEngine(policy, seed=8)
    rates = [0.7] * 4
    cheap = lambda batch, k: 4.0 + 0.3 * k  # noqa: E731 -- k = 4 the best
    costly = lambda batch, k: 4.0 + 4.0 * k  # noqa: E731 -- drafts cost a full step: k = 0
    assert best_fixed_k(1, rates, cheap) == 4 and best_fixed_k(1, rates, costly) == 0
    assert engine.run(1, rates, cheap, 150)["chosen"][-30:].count(4) >= 26
    # The chosen k is timed every step: a rise in its cost shows at once.
    assert engine.run(1, rates, costly, 100)["chosen"][-50:].count(0) >= 48
    # Cheap again: the other k's costs go stale and are timed again when they might win.
    back = engine.run(1, rates, cheap, 900)
    assert back["chosen"][-50:].count(4) >= 45, back["chosen"][-50:]


def test_a_k_that_cannot_win_is_not_explored_once_its_cost_is_known():
    # Each draft adds 1.3 steps: even if every draft were accepted, k more tokens cost 1.3 k steps.
    policy = AdaptiveDraftLength(LearnedStepCosts(4))
    engine = SimulatedEngine(policy, seed=9, noise=0.01)
    proportional = lambda batch, k: 5.0 * (1 + 1.3 * k)  # noqa: E731
    engine.run(8, [0.5] * 4, proportional, 300)
    learning = engine.run(8, [0.5] * 4, proportional, 1500)  # each k timed once (the gaps grow)
    assert learning["exploring_share"] < 0.01
    assert all(ms is not None for ms in policy.costs.as_dict()["step_ms"][0])
    explored_before = policy.num_explorations
    late = engine.run(8, [0.5] * 4, proportional, 1500)
    assert late["chosen"] == [0] * 1500
    assert policy.num_explorations == explored_before
    # The positions' evidence has aged meanwhile (uncertain acceptance): hope alone cannot pay.
    assert policy.estimate.first_uncertain_position() == 0


@pytest.mark.parametrize("batch", [1, 16])
def test_issue_28_h200_runs_reach_the_bar_in_simulation(batch):
    """check_adaptive_gpu.py's shape: a warm-up run then a timed run of 128 tokens at a simulated
    mean acceptance length of 2.93 (conditional 0.79), costs as the H200 learned them (ms)."""
    h200 = {1: [4.0, 4.4, 4.9, 5.5, 6.1], 16: [4.11, 4.53, 5.66, 6.0, 7.74]}[batch]
    steps = 45  # 128 tokens at 2.93 a step
    for seed in range(6):
        policy = AdaptiveDraftLength(LearnedStepCosts(4))
        engine = SimulatedEngine(policy, seed=seed)
        engine.run(batch, [0.79] * 4, lambda b, k: h200[k], steps)
        timed = engine.run(batch, [0.79] * 4, lambda b, k: h200[k], steps)
        assert timed["efficiency"] >= 0.97, (seed, timed)


def test_acceptance_evidence_fades_where_reached_and_ages_elsewhere():
    estimate = AcceptanceEstimate(3, fade=0.5, prior_rate=0.5, prior_weight=1.0, chain_prior_weight=1.0)
    estimate.observe(3, 3)
    estimate.end_step()
    assert estimate.tried == [0.5, 0.5, 0.5]  # every position reached: all faded
    estimate.observe(1, 1)
    estimate.end_step()
    assert estimate.tried == pytest.approx([0.75, 0.5, 0.5])  # only position 1 reached this time
    # Position 3, unreached for EXPLORE_MAX_GAP steps, has its evidence aged; position 1 none.
    for _ in range(EXPLORE_MAX_GAP):
        estimate.observe(1, 1)
        estimate.end_step()
    evidence = estimate.evidence()
    assert evidence[0] == pytest.approx(estimate.tried[0]) and evidence[2] < 0.5 * estimate.tried[2]
    assert estimate.first_uncertain_position() == 0  # fade 0.5: position 1 holds about 1 observation
    optimistic = estimate.optimistic_rates()
    assert all(o >= r for o, r in zip(optimistic, estimate.rates())) and max(optimistic) <= 1.0
