"""Adaptive speculation's start-up step costs (runner/startup_costs.py) and the seeded cost table
(engine/step_costs.py): the priors a fake replay timer gives (verify + draft per k, one graph
bucket per power-of-two batch, the time budget), seeded cells against hand-computed costs (prior
plus the host offset learned from timed steps), the policy on seeded costs (first choice the best
k, no cost exploration, few steps away from the best k in a long run), and the measurement over a
CPU runner's uncaptured graphs with a wall clock (it leaves nothing behind: the same tokens)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from foretell import LLM, SamplingParams
from foretell.engine.step_costs import LearnedStepCosts
from foretell.runner.cuda_graph import batch_buckets
from foretell.runner.startup_costs import GraphReplayTimer, prior_batches, replay_timer_for, time_step_priors
from foretell.spec_decode.acceptance_estimate import AcceptanceEstimate
from foretell.spec_decode.adaptive import AdaptiveDraftLength
from tests.fixtures.adaptive_sim import SimulatedEngine, expected_tokens


def device_ms(batch: int, k: int) -> float:
    """What a verify + draft-loop replay of a steady step drafting k costs (ms): a base, verify
    rows growing with the batch, a draft pass per draft."""
    return 4.0 + 0.02 * batch * (k + 1) + 0.45 * k + 0.004 * batch * k


class FakeTimer:
    """Verify and draft seconds from device_ms (split 80 / 20), each call advancing a fake clock."""

    def __init__(self):
        self.now = 0.0
        self.calls: list[tuple] = []

    def clock(self) -> float:
        return self.now

    def verify_seconds(self, bucket: int, q: int) -> float:
        self.calls.append(("verify", bucket, q))
        self.now += 0.8 * device_ms(bucket, q - 1) / 1000
        return 0.8 * device_ms(bucket, q - 1) / 1000

    def draft_seconds(self, bucket: int, q: int, m: int) -> float:
        self.calls.append(("draft", bucket, q, m))
        self.now += 0.2 * device_ms(bucket, m) / 1000
        return 0.2 * device_ms(bucket, m) / 1000


# ---------------------------------------------------------------------- the measurement, faked

def test_priors_are_verify_plus_draft_per_k_at_each_power_of_two():
    timer = FakeTimer()
    priors = time_step_priors(batch_buckets(40), 3, timer, clock=timer.clock)
    assert sorted(priors) == [1, 2, 4, 8, 16, 32]  # buckets 1 2 4 8 16 24 32 40: no 64
    for batch, seconds in priors.items():
        assert seconds == pytest.approx([device_ms(batch, k) / 1000 for k in range(4)])
    # Each k: the verify of k + 1 rows, then the draft loop after it drafting k (a steady step).
    assert timer.calls[:4] == [("verify", 1, 1), ("draft", 1, 1, 0), ("verify", 1, 2), ("draft", 1, 2, 1)]
    assert len(timer.calls) == 6 * 4 * 2


def test_each_batch_replays_the_smallest_graph_bucket_that_holds_it():
    assert prior_batches(batch_buckets(256)) == [(b, b) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert prior_batches(batch_buckets(100)) == [(b, b) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert prior_batches([1, 3, 6]) == [(1, 1), (2, 3), (4, 6)]


def test_timing_starts_no_batch_past_its_budget():
    timer = FakeTimer()
    # Batches 1, 2, 4 take ~20 ms each for K = 3 (four steps of ~4-6 ms): 45 ms is spent after the
    # third, which still starts (the budget is checked before each batch).
    priors = time_step_priors(batch_buckets(256), 3, timer, budget_seconds=0.045, clock=timer.clock)
    assert sorted(priors) == [1, 2, 4]
    assert all(len(seconds) == 4 for seconds in priors.values())  # a batch is timed whole or not at all


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="max_k >= 1 and graph buckets; got 0"):
        time_step_priors([1, 2], 0, FakeTimer())
    with pytest.raises(ValueError, match=r"needs batch_size >= 1 and 3 seconds > 0 \(k = 0..2\); got batch_size 4, "
                                         r"seconds \[1.0, 2.0\]"):
        LearnedStepCosts(2, priors={4: [1.0, 2.0]})
    with pytest.raises(ValueError, match="seconds > 0"):
        LearnedStepCosts(1, priors={1: [1.0, 0.0]})


def test_nothing_is_timed_without_captured_graphs():
    assert replay_timer_for(None, None, 4, 1024) is None


# ---------------------------------------------------------------------- the seeded cost table

def timed(costs: LearnedStepCosts, batch: int, k: int, *seconds: float) -> None:
    for s in seconds:
        costs.record(batch, k, s)


def test_seeded_cells_are_priors_plus_the_host_offset():
    costs = LearnedStepCosts(3, stale_after_steps=6, priors={1: [1.0, 1.1, 1.2, 1.3], 4: [2.0, 2.2, 2.4, 2.6]})
    assert costs.seconds_by_k(1) == pytest.approx([1.0, 1.1, 1.2, 1.3])  # no step yet: offset 0
    assert costs.needs_timing(1) == [] and costs.needs_timing(4) == []  # nothing to time: exploration is for acceptance
    assert costs.optimistic_seconds_by_k(4) == pytest.approx(costs.seconds_by_k(4))
    assert costs.steady_steps_to_learn(1, 3) == 0
    timed(costs, 1, 2, 9.0, 1.7, 1.7)  # the first dropped; k = 2 costs its prior + 0.5 of host work
    assert costs.seconds_by_k(1) == pytest.approx([1.5, 1.6, 1.7, 1.8])
    assert costs.seconds_by_k(5) == pytest.approx([2.5, 2.7, 2.9, 3.1])  # bucket 4-7 borrows batch 1's offset
    timed(costs, 5, 0, 9.0, 2.3)  # its own offset: 0.3
    assert costs.seconds_by_k(4) == pytest.approx([2.3, 2.5, 2.7, 2.9])
    assert costs.seconds_by_k(1) == pytest.approx([1.5, 1.6, 1.7, 1.8])
    table = costs.as_dict()
    assert table["batch_sizes"] == [1, 4] and table["prior_ms"] == [[1000.0, 1100.0, 1200.0, 1300.0],
                                                                  [2000.0, 2200.0, 2400.0, 2600.0]]
    assert table["step_ms"][1] == [2300.0, None, None, None]


def test_a_seeded_bucket_prices_every_k_from_the_steps_just_run():
    # Contexts grow through a run: k = 0 ran early (offset 0.1), k = 1 runs now at 0.9 over its prior.
    # Every k moves with the recent steps; k = 0 keeps no price of its own from its early, short contexts.
    costs = LearnedStepCosts(2, priors={256: [10.0, 15.0, 22.0]})
    timed(costs, 256, 0, 9.0, *[10.1] * 5)
    assert costs.seconds_by_k(256) == pytest.approx([10.1, 15.1, 22.1])
    timed(costs, 256, 1, 99.0, *[15.9] * 8)  # a full window of k = 1 steps (the first dropped)
    assert costs.seconds_by_k(256) == pytest.approx([10.9, 15.9, 22.9])
    assert costs.as_dict()["step_ms"][0][:2] == [10100.0, 15900.0]  # the cells' own times, for the stats
    timed(costs, 256, 1, *[15.4] * 4)  # half the window at 0.4: the lower median
    assert costs.seconds_by_k(256) == pytest.approx([10.4, 15.4, 22.4])


def test_a_bucket_without_priors_learns_as_before():
    costs = LearnedStepCosts(2, priors={1: [1.0, 1.1, 1.2]})
    assert costs.needs_timing(64) == [0, 1, 2] and costs.steady_steps_to_learn(64, 1) == 2
    timed(costs, 64, 0, 9.0, 5.0)
    timed(costs, 64, 2, 9.0, 7.0)
    assert costs.seconds_by_k(64) == pytest.approx([5.0, 6.0, 7.0])  # linear through its own cells


# ---------------------------------------------------------------------- the policy on seeded costs

def true_ms(batch: int, k: int) -> float:
    """A real step: the replays' device time and the host work a replay does not hold."""
    return device_ms(batch, k) + 0.3 + 0.002 * batch


def run(policy: AdaptiveDraftLength, batch: int, rates: list[float], steps: int, rng: random.Random) -> list[int]:
    """The simulated engine's steps (2% timing noise; a switch step costs the mean of the two k),
    drawing from the caller's generator: the k chosen each step."""
    return SimulatedEngine(policy, rng=rng).run(batch, rates, true_ms, steps)["chosen"]


def seeded_policy(max_num_seqs: int, replay_error: float, rng: random.Random,
                  prior_rate: float | None = None) -> AdaptiveDraftLength:
    """A policy whose costs are seeded from the fake replays, each off by up to replay_error
    (prior_rate: the acceptance estimate's prior; None: its default)."""
    timer = FakeTimer()
    priors = time_step_priors(batch_buckets(max_num_seqs), 4, timer, clock=timer.clock)
    priors = {b: [s * rng.uniform(1 - replay_error, 1 + replay_error) for s in row] for b, row in priors.items()}
    estimate = AcceptanceEstimate(4) if prior_rate is None else AcceptanceEstimate(4, prior_rate=prior_rate)
    return AdaptiveDraftLength(LearnedStepCosts(4, priors=priors), estimate)


def clearly_best(batch: int, rates: list[float]) -> int:
    """The best fixed k of the true costs; the test's cases have one at least 3% ahead."""
    by_k = [expected_tokens(rates, k) / true_ms(batch, k) for k in range(5)]
    best = max(range(5), key=lambda k: by_k[k])
    assert by_k[best] > 1.03 * max(r for k, r in enumerate(by_k) if k != best)
    return best


CASES = [(1, 0.79), (1, 0.0), (16, 0.36), (16, 0.9), (64, 0.5), (256, 0.79), (256, 0.1)]


@pytest.mark.parametrize("batch, rate", CASES)
def test_seeded_costs_make_the_first_choice_the_best_k_without_cost_exploration(batch, rate):
    rng = random.Random(batch)
    policy = seeded_policy(256, 0.01, rng, prior_rate=rate)  # acceptance known: the costs decide
    best = clearly_best(batch, [rate] * 4)
    chosen = run(policy, batch, [rate] * 4, 60, rng)
    assert chosen[0] == best  # (later steps follow the acceptance seen: the next test)
    assert all(not policy.costs.needs_timing(b) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256))
    # Explorations (if any: for acceptance) hold one switch step, none a steady step for its cost.
    assert policy.num_exploring_steps == policy.num_explorations


@pytest.mark.parametrize("batch, rate", CASES)
def test_seeded_costs_spend_under_two_percent_of_a_long_run_away_from_the_best_k(batch, rate):
    rng = random.Random(100 + batch)
    policy = seeded_policy(256, 0.02, rng)  # acceptance learned from its prior (0.75)
    best = clearly_best(batch, [rate] * 4)
    chosen = run(policy, batch, [rate] * 4, 2000, rng)
    away = sum(k != best for k in chosen)
    assert away < 0.02 * len(chosen), (away, chosen[:40], policy.stats())
    assert policy.num_exploring_steps == policy.num_explorations  # for acceptance only
    assert chosen[-500:].count(best) >= 495


def test_the_learned_host_offset_does_not_move_the_choice():
    # Replays 10% off, the host adds 0.3 ms and more with the batch: the choice stays the best.
    rng = random.Random(3)
    policy = seeded_policy(16, 0.1, rng)
    chosen = run(policy, 16, [0.79] * 4, 400, rng)
    assert chosen[-300:].count(4) >= 297
    measured = policy.costs.seconds_by_k(16)
    assert measured[4] == pytest.approx(true_ms(16, 4) / 1000, rel=0.03)  # the running k: its own steps
    # The others: the prior plus the offset the running k showed (replay error aside).
    assert all(m == pytest.approx(true_ms(16, k) / 1000, rel=0.12) for k, m in enumerate(measured))


# ---------------------------------------------------------------------- over a CPU runner's graphs

def test_priors_from_a_cpu_runners_uncaptured_graphs_leave_nothing_behind(qwen3_checkpoint, eagle3_head):
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, max_num_seqs=4, skip_tokenizer_init=True,
              speculative_config={"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": "auto"})
    runner = llm.engine.runner
    assert llm.get_stats()["adaptive_step_costs"]["prior_ms"] == []  # the CPU seeds nothing
    prompts = [{"prompt_token_ids": [(5 * i + j) % 200 + 1 for j in range(9 + i)]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    replays = []

    def wall_clock(replay, n):
        start = time.perf_counter()
        for _ in range(n):
            replay()
        replays.append(n)
        return (time.perf_counter() - start) / n

    timer = GraphReplayTimer(runner.padded_forward, runner.draft_graphs, context_len=20, time_replays=wall_clock,
                             replays=1)
    with torch.inference_mode():
        priors = time_step_priors(runner.padded_forward.buckets, 4, timer)
    runner.reset_pipeline()
    # 5 verify replays a batch, 4 of the draft loop: k = 0 runs no drafter (adaptive_skip_catch_up)
    assert sorted(priors) == [1, 2, 4] and len(replays) == 3 * (5 + 4)
    loop = runner.draft_graphs  # the verifier's outputs that padding sequences keep: as built
    assert not loop.accepted.any() and not loop.next_token.any() and int(loop.num_live) == 0
    assert all(len(row) == 5 and min(row) > 0 for row in priors.values())
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert after == before  # the KV the replays wrote is rewritten before it is read: the same tokens
