"""Adaptive speculation's step costs learned from the engine's own steps (engine/step_costs.py,
AdaptiveDraftLength.record_step): the cost table against hand-computed values (dropped first step,
lower median, estimates of untimed cells, staleness), the policy driven by a fake clock whose true
costs it must find (the best k per batch size, exploring only k that might compete, timing only
steady steps), and the engine: nothing run at start-up, costs learned from real steps."""

from __future__ import annotations

import random

import pytest

from foretell import LLM, SamplingParams
from foretell.engine.step_costs import PRIOR_COST_PER_DRAFT, LearnedStepCosts
from foretell.spec_decode.adaptive import EXPLORE_EVERY, EXPLORE_MAX_GAP, AdaptiveDraftLength


def timed(costs: LearnedStepCosts, batch: int, k: int, *seconds: float) -> None:
    for s in seconds:
        costs.record(batch, k, s)


def test_a_cell_drops_its_first_step_and_keeps_the_lower_median_of_the_last_five():
    costs = LearnedStepCosts(2)
    costs.record(3, 1, 9.0)  # the first steady step at (2-3, 1): may have compiled kernels
    assert costs.needs_timing(2) == [0, 1, 2]
    timed(costs, 2, 1, 4.0)
    assert costs.step_seconds(3, 1) == 4.0 and costs.needs_timing(3) == [0, 1, 2]  # one kept: not converged
    timed(costs, 3, 1, 2.0)
    assert costs.step_seconds(2, 1) == 2.0  # lower median of [4, 2]
    assert costs.needs_timing(2) == [0, 1, 2]  # two that disagree: not converged
    timed(costs, 2, 1, 3.0, 100.0, 5.0)  # a slow spell does not move it
    assert costs.step_seconds(2, 1) == 4.0  # [4, 2, 3, 100, 5] -> 2 3 [4] 5 100
    assert costs.needs_timing(2) == [0, 2]  # a full window: converged however scattered
    timed(costs, 2, 1, 6.0, 7.0, 8.0)  # only the last five count: [100, 5, 6, 7, 8]
    assert costs.step_seconds(2, 1) == 7.0
    stats = costs.as_dict()
    assert stats["batch_sizes"] == [2] and stats["step_ms"] == [[None, 7000.0, None]]
    assert stats["timed_steps"] == [[0, 5, 0]] and stats["learned"] is True


def test_buckets_are_powers_of_two():
    assert [LearnedStepCosts.bucket_of(b) for b in (1, 2, 3, 4, 7, 8, 255, 256)] == [1, 2, 2, 4, 4, 8, 128, 256]


def test_untimed_cells_are_estimated():
    costs = LearnedStepCosts(4)
    # Nothing timed: the prior profile (only relative costs matter to the choice).
    prior = [1 + PRIOR_COST_PER_DRAFT * k for k in range(5)]
    assert [costs.step_seconds(1, k) for k in range(5)] == pytest.approx(prior)
    # One k timed at batch 1: its cost times the prior profile.
    timed(costs, 1, 2, 9.0, 2.4)  # (the first step of a cell is dropped)
    assert costs.step_seconds(1, 0) == pytest.approx(2.4 / 1.2)
    assert costs.step_seconds(1, 4) == pytest.approx(2.4 * 1.4 / 1.2)
    # Two timed: linear through them, extrapolated with their slope.
    timed(costs, 1, 4, 9.0, 3.0)
    assert [costs.step_seconds(1, k) for k in range(5)] == pytest.approx([1.8, 2.1, 2.4, 2.7, 3.0])
    # Three timed: piecewise linear; outside, the slope of the nearest two.
    timed(costs, 1, 3, 9.0, 2.5)
    assert [costs.step_seconds(1, k) for k in range(5)] == pytest.approx([2.2, 2.3, 2.4, 2.5, 3.0])
    # A bucket with nothing timed borrows the nearest one's curve.
    assert costs.step_seconds(16, 0) == pytest.approx(2.2)
    # One k timed at batch 8: its cost times the relative costs of batch 1's curve.
    timed(costs, 8, 1, 9.0, 4.6)
    assert [costs.step_seconds(8, k) for k in range(5)] == pytest.approx([4.4, 4.6, 4.8, 5.0, 6.0])
    # Timed k = 0 and 1 at batch 8 (a falling noisy slope): extrapolated up, never cheaper than k = 1.
    timed(costs, 8, 0, 9.0, 5.0)
    assert [costs.step_seconds(8, k) for k in range(5)] == pytest.approx([5.0, 4.6, 4.6, 4.6, 4.6])
    assert costs.step_seconds(16, 0) == pytest.approx(5.0)  # now the nearest bucket with a cost is 8
    assert costs.seconds_by_k(1) == pytest.approx([2.2, 2.3, 2.4, 2.5, 3.0])  # batch 1's own, unchanged
    # Extrapolating down stops at a tenth of the nearest timed cost.
    steep = LearnedStepCosts(4)
    timed(steep, 1, 3, 9.0, 1.0)
    timed(steep, 1, 4, 9.0, 5.0)
    assert steep.step_seconds(1, 0) == pytest.approx(0.1)


def test_cells_go_stale():
    costs = LearnedStepCosts(1, stale_after_steps=4)
    timed(costs, 1, 0, 1.0, 1.0, 1.02)  # the first dropped, two kept within 5%: converged
    timed(costs, 1, 1, 1.0, 1.0, 1.0)
    assert costs.needs_timing(1) == []
    timed(costs, 1, 1, 1.0, 1.0, 1.0, 1.0)
    assert costs.needs_timing(1) == [0]  # last timed 7 steady steps ago
    timed(costs, 1, 0, 3.0)  # timed again: its old steps are forgotten, the new one is its cost
    assert costs.step_seconds(1, 0) == 3.0 and costs.needs_timing(1) == [0]  # one step: not converged
    assert costs.needs_timing(64) == [0, 1]  # a bucket never run


def test_convergence_and_optimistic_costs():
    costs = LearnedStepCosts(3)
    assert costs.optimistic_seconds_by_k(1) == pytest.approx([0.8 * s for s in costs.seconds_by_k(1)])
    assert costs.steady_steps_to_learn(1, 2) == 2  # nothing seen: a dropped step, then a kept one
    timed(costs, 1, 1, 9.0, 2.0)
    assert costs.steady_steps_to_learn(1, 1) == 1 and costs.steady_steps_to_learn(1, 2) == 2
    timed(costs, 1, 1, 2.05)  # two kept steps within 5%: converged
    assert costs.steady_steps_to_learn(1, 1) == 0 and 1 not in costs.needs_timing(1)
    timed(costs, 1, 3, 9.0, 4.0)  # one kept step at k = 3: not converged
    estimate = costs.seconds_by_k(1)  # linear through (1, 2.0) and (3, 4.0)
    assert estimate == pytest.approx([1.0, 2.0, 3.0, 4.0])
    hopes = costs.optimistic_seconds_by_k(1)
    # k = 0 untimed: its estimate less a fifth; k = 1 converged: its cost; k = 2 untimed: its
    # estimate less a fifth but no cheaper than k = 1 might be; k = 3: its fastest step less 5%.
    assert hopes == pytest.approx([0.8, 2.0, max(0.8 * 3.0, 0.95 * 2.0), 0.95 * 4.0])
    timed(costs, 1, 3, 5.0)  # scattered: still not converged, the fastest still 4.0
    assert 3 in costs.needs_timing(1) and costs.optimistic_seconds_by_k(1)[3] == pytest.approx(3.8)
    # An untimed k above a timed one is never hoped cheaper than that one (a draft costs something).
    floor = LearnedStepCosts(2)
    timed(floor, 1, 0, 9.0, 5.0)
    timed(floor, 1, 1, 9.0, 5.1, 5.1)
    assert floor.optimistic_seconds_by_k(1)[2] >= 5.1 * 0.95


@pytest.mark.parametrize("call, message", [
    (lambda: LearnedStepCosts(0), "max_k >= 1, got 0"),
    (lambda: LearnedStepCosts(2, stale_after_steps=0), "stale_after_steps >= 1, got 0"),
    (lambda: LearnedStepCosts(2).record(1, 3, 1.0), r"k in 0..2 and seconds > 0; got 1, 3, 1.0"),
    (lambda: LearnedStepCosts(2).record(0, 1, 1.0), "batch_size >= 1"),
    (lambda: LearnedStepCosts(2).record(1, 1, 0.0), "seconds > 0; got 1, 1, 0.0"),
])
def test_bad_input_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------------- the policy on a fake clock

def cheap_then_costly(batch: int, k: int) -> float:
    """True step seconds: drafts cost little at batch 1, each doubles the step at 64."""
    return 0.01 * (1 + 0.1 * k) if batch < 2 else 0.64 * (1 + 1.0 * k)


def drive(policy: AdaptiveDraftLength, batch: int, rates: list[float], steps: int, rng: random.Random,
          true_seconds=cheap_then_costly, rows=None, explorations: list[int] | None = None) -> list[int]:
    """Run the policy like the engine: choose (schedule), verify the drafts chosen the step before
    with fake acceptance, then report the step's time (verifying k_prev and drafting k cost half of
    each steady step) and rows. explorations: gets the index of each step that began one."""
    chosen = []
    for _ in range(steps):
        verifies, began = policy.last, policy.num_explorations
        k = policy.choose(batch)
        if explorations is not None and policy.num_explorations > began:
            explorations.append(len(chosen))
        for _ in range(batch):
            accepted = 0
            while accepted < verifies and rng.random() < rates[accepted]:
                accepted += 1
            policy.observe(verifies, accepted)
        seconds = 0.5 * (true_seconds(batch, verifies) + true_seconds(batch, k)) * rng.uniform(0.97, 1.03)
        policy.record_step(seconds, batch, batch * (verifies + 1) if rows is None else rows)
        chosen.append(k)
    return chosen


def test_the_policy_learns_each_batch_sizes_best_k():
    rng = random.Random(0)
    policy = AdaptiveDraftLength(LearnedStepCosts(4))
    early = drive(policy, 1, [0.9] * 4, 100, rng)
    assert early[0] == 4 and early[-30:] == [4] * 30  # the prior (cheap drafts), then the learned costs
    late = drive(policy, 64, [0.9] * 4, 100, rng)[40:]
    assert late.count(0) >= 55  # verifying drafts at 64 costs more than it gains
    costs = policy.stats()["adaptive_step_costs"]
    assert costs["batch_sizes"] == [1, 64]
    at_64 = costs["step_ms"][1]
    assert at_64[0] == pytest.approx(640, rel=0.05) and at_64[4] == pytest.approx(3200, rel=0.05)
    # Exploration timed only k that might compete: at batch 1 k = 0 and 1 (far behind) never ran.
    assert costs["step_ms"][0][:2] == [None, None]
    assert policy.stats()["adaptive_timed_steps"] > 150 and policy.stats()["adaptive_explorations"] >= 2


def test_explorations_hold_what_they_need_and_come_at_doubling_gaps():
    rng = random.Random(1)
    policy = AdaptiveDraftLength(LearnedStepCosts(4))
    flat = lambda batch, k: 0.01 * (1 + 0.15 * k)  # noqa: E731 -- every k competes at first
    began: list[int] = []
    chosen = drive(policy, 1, [0.7] * 4, 400, rng, true_seconds=flat, explorations=began)
    assert len(began) >= 3
    assert began[0] == EXPLORE_EVERY - 1  # the first look, at the bucket's EXPLORE_EVERY-th step
    gaps = [b - a for a, b in zip(began, began[1:])]
    # Each gap at least doubles (counted from the look; a look that found nothing waits a gap more).
    for i, gap in enumerate(gaps):
        assert gap >= min(EXPLORE_EVERY * 2 ** (i + 1), EXPLORE_MAX_GAP), gaps
    # An exploration holds its k for the switch step and the steady steps its cost needs (0 to 2).
    assert len(began) <= policy.num_exploring_steps <= 3 * len(began)
    # The costs found: k = 3 the best of E(k) / T(k) with a = 0.7 and a 15% cost per draft.
    assert chosen[-50:].count(3) >= 48
    assert sum(ms is not None for ms in policy.costs.as_dict()["step_ms"][0]) >= 3


def test_only_steady_steps_are_timed():
    policy = AdaptiveDraftLength(LearnedStepCosts(2))
    assert policy.choose(4) == 2  # verifies 2 (the initial k), drafts 2
    policy.record_step(0.5, 4, 4 * 3 + 5)  # prefill rows ride along: not a verify-only step
    policy.record_step(0.5, 5, 4 * 3)  # a sequence that does not sample
    assert policy.num_timed_steps == 0
    policy.choose(0)  # nothing samples (all prefilling): no choice, nothing timed
    policy.record_step(0.5, 2, 2 * 3)
    assert policy.num_timed_steps == 0
    policy.choose(4)
    policy.record_step(0.5, 4, 4 * 3)
    assert policy.num_timed_steps == 1
    policy.costs = LearnedStepCosts(2)
    policy.last = 1  # a switch from 1 to 2: it verifies 1 and drafts 2
    assert policy.choose(4) == 2
    policy.record_step(0.5, 4, 4 * 2)
    assert policy.num_timed_steps == 1


# ---------------------------------------------------------------------- the engine

def test_the_engine_starts_without_measuring_and_learns_from_its_steps(qwen3_checkpoint, eagle3_head):
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, max_num_seqs=64,
              speculative_config={"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": "auto"})
    assert llm.engine.runner.pipeline.kinds[0].num_steps == 0  # no step ran at start-up
    stats = llm.get_stats()
    assert stats["adaptive_step_costs"]["batch_sizes"] == [] and stats["adaptive_timed_steps"] == 0
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm.generate(["The cat reads", "a b a b a b", "Question: 3 plus 7?"], params, use_tqdm=False)
    stats = llm.get_stats()
    costs = stats["adaptive_step_costs"]
    assert 2 in costs["batch_sizes"] and stats["adaptive_timed_steps"] >= 5  # batch 3: bucket 2-3
    row = costs["batch_sizes"].index(2)
    assert sum(costs["timed_steps"][row]) >= 3 and all(ms is None or ms > 0 for ms in costs["step_ms"][row])
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
