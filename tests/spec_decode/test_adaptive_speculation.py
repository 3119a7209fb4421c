"""Adaptive speculation (spec_decode/adaptive.py): the policy against a fixed fake cost model and
fake acceptance (learned costs: tests/engine/test_step_costs.py), the config's forms and errors,
and the engine: greedy output equal to plain output, the chosen draft lengths in get_stats(), k
falling to 0 when nothing is accepted and probes after that."""

from __future__ import annotations

import random

import pytest

from foretell import LLM, SamplingParams
from foretell.config import SpeculativeConfig
from foretell.spec_decode.acceptance_estimate import AcceptanceEstimate
from foretell.spec_decode.adaptive import (
    ADAPTIVE_DEFAULT_MAX_K,
    AdaptiveDraftLength,
    StepCostModel,
)


def costs(per_k: list[float], growth: list[float] | None = None, sizes=(1, 8, 64)) -> StepCostModel:
    """A fake cost model: step seconds at batch sizes `sizes`; per_k at the first, each later one
    multiplied by its growth factor per k (default: the same cost at every batch)."""
    rows = []
    for i, _ in enumerate(sizes):
        factor = 1.0 if growth is None else growth[i]
        rows.append(tuple(t * (1 + (factor - 1) * k) for k, t in enumerate(per_k)))
    return StepCostModel(tuple(sizes), tuple(rows))


def run(policy: AdaptiveDraftLength, batch: int, rates: list[float], steps: int, rng: random.Random) -> list[int]:
    """Drive the policy like the engine: choose, then every sequence verifies that many drafts,
    each accepted with the conditional rate of its position (fake acceptance)."""
    chosen = []
    drafts = 0
    for _ in range(steps):
        for _ in range(batch):
            if drafts:
                accepted = 0
                while accepted < drafts and rng.random() < rates[accepted]:
                    accepted += 1
                policy.observe(drafts, accepted)
        drafts = policy.choose(batch)
        chosen.append(drafts)
    return chosen


CHEAP = [1.0, 1.1, 1.2, 1.3, 1.4]  # each draft adds a tenth of a decode step


def test_high_acceptance_and_cheap_verify_choose_the_most():
    policy = AdaptiveDraftLength(costs(CHEAP))
    chosen = run(policy, 1, [0.9] * 4, 60, random.Random(0))
    assert chosen[-20:] == [4] * 20
    assert policy.stats()["adaptive_chosen_k_histogram"][4] >= 50


def test_no_acceptance_goes_to_zero_and_keeps_probing():
    policy = AdaptiveDraftLength(costs(CHEAP))
    chosen = run(policy, 1, [0.0] * 4, 300, random.Random(0))
    assert 0 in chosen[:8]  # within a few steps
    late = chosen[100:]
    zero_share = late.count(0) / len(late)
    assert zero_share > 0.85, zero_share
    assert any(k > 0 for k in late)  # still probing: the estimate does not freeze at 0
    assert policy.stats()["adaptive_acceptance_estimate"][0] < 0.3


def test_verify_cost_exploding_with_batch_chooses_zero():
    # Cheap at batch 1; at 64 each draft doubles the step (verification competes with the batch).
    model = costs(CHEAP, growth=[1.0, 1.2, 2.0])
    policy = AdaptiveDraftLength(model)
    assert run(policy, 1, [0.8] * 4, 40, random.Random(1))[-10:] == [4] * 10
    late = run(policy, 64, [0.8] * 4, 200, random.Random(2))[50:]
    assert late.count(0) / len(late) > 0.95
    # The interpolated cost between measured sizes: halfway between 8 and 64 is the mean.
    assert model.step_seconds(36, 2) == pytest.approx((model.step_seconds(8, 2) + model.step_seconds(64, 2)) / 2)
    assert model.step_seconds(128, 1) == pytest.approx(2 * model.step_seconds(64, 1))  # per sequence past the last


def test_a_middle_length_wins_when_late_positions_rarely_pass():
    # Conditional rates 0.9, 0.9, 0.1, 0.1 and a steep cost per draft: k = 2 has the best rate.
    policy = AdaptiveDraftLength(costs([1.0, 1.3, 1.6, 1.9, 2.2]))
    chosen = run(policy, 8, [0.9, 0.9, 0.1, 0.1], 200, random.Random(3))
    late = chosen[50:]
    assert max(set(late), key=late.count) == 2


def test_the_estimate_adapts_when_acceptance_changes():
    rng = random.Random(4)
    policy = AdaptiveDraftLength(costs(CHEAP))
    assert run(policy, 4, [0.9] * 4, 60, rng)[-10:] == [4] * 10
    after_drop = run(policy, 4, [0.0] * 4, 120, rng)  # about a 33-step memory
    assert after_drop[-20:].count(0) >= 16
    after_rise = run(policy, 4, [0.9] * 4, 400, rng)
    assert after_rise[-20:] == [4] * 20  # probes found the acceptance back
    rates = policy.estimate.rates()
    assert rates[0] > 0.8


def test_estimate_counts_tried_positions_only():
    estimate = AcceptanceEstimate(3, fade=1.0, prior_rate=0.5, prior_weight=1.0, chain_prior_weight=1.0)
    estimate.observe(3, 1)  # position 1 accepted, 2 rejected, 3 never reached
    estimate.observe(2, 2)
    assert estimate.tried == [2.0, 2.0, 0.0]
    assert estimate.accepted == [2.0, 1.0, 0.0]
    # Each position's prior is the estimate before it: position 3, never reached, takes position 2's.
    first = 2.5 / 3
    second = (1 + first) / 3
    assert estimate.rates() == pytest.approx([first, second, second])
    expected = estimate.expected_tokens([0.5, 0.5, 0.5])
    assert expected == pytest.approx([1.0, 1.5, 1.75, 1.875])


@pytest.mark.parametrize("sizes, rows", [
    ((), ()),
    ((4, 2), ((1.0, 1.1), (1.0, 1.1))),
    ((1,), ((1.0,),)),
    ((1, 2), ((1.0, 1.1),)),
    ((1,), ((1.0, 0.0),)),
])
def test_bad_cost_models_are_refused(sizes, rows):
    with pytest.raises(ValueError, match="StepCostModel"):
        StepCostModel(sizes, rows)


def test_config_forms_and_errors():
    auto = SpeculativeConfig(method="ngram", num_speculative_tokens="auto")
    assert auto.adaptive is True and auto.num_speculative_tokens == ADAPTIVE_DEFAULT_MAX_K
    flagged = SpeculativeConfig(method="ngram", num_speculative_tokens=2, adaptive=True)
    assert flagged.adaptive is True and flagged.num_speculative_tokens == 2
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=2).adaptive is False
    with pytest.raises(ValueError, match="integer >= 1 or 'auto', got 'fast'"):
        SpeculativeConfig(method="ngram", num_speculative_tokens="fast")
    with pytest.raises(ValueError, match="adaptive is false"):
        SpeculativeConfig(method="ngram", num_speculative_tokens="auto", adaptive=False)
    with pytest.raises(ValueError, match="adaptive must be true or false, got 'yes'"):
        SpeculativeConfig(method="ngram", adaptive="yes")
    with pytest.raises(ValueError, match="at most 8, got 9"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=9, adaptive=True)


def test_cli_flags_build_an_adaptive_config():
    import argparse

    from foretell.cli_args import add_engine_args, speculative_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_required=False)
    args = parser.parse_args(["--method", "ngram", "--num-speculative-tokens", "auto"])
    assert speculative_config_from_args(args)["num_speculative_tokens"] == "auto"
    args = parser.parse_args(["--method", "ngram", "--num-speculative-tokens", "3", "--adaptive-speculation"])
    config = speculative_config_from_args(args)
    assert config["num_speculative_tokens"] == 3 and config["adaptive"] is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--method", "ngram", "--num-speculative-tokens", "lots"])


# ---------------------------------------------------------------------- the engine

PROMPTS = ["The cat reads the book. The cat reads the book. The cat", "Question: what is 3 plus 7? Answer:",
           "a b a b a b", "def add(x):\n    return x + 1\ndef add(x):\n    return"]
ENGINE = dict(dtype="float32", num_kv_blocks=128, max_num_seqs=4)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_adaptive_greedy_output_equals_plain(qwen3_checkpoint, eagle3_head):
    plain = LLM(qwen3_checkpoint, **ENGINE).generate(PROMPTS, greedy(24), use_tqdm=False)
    llm = LLM(qwen3_checkpoint, speculative_config={"method": "eagle3", "model": eagle3_head,
                                                    "num_speculative_tokens": "auto"}, **ENGINE)
    outs = llm.generate(PROMPTS, greedy(24), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    stats = llm.get_stats()
    histogram = stats["adaptive_chosen_k_histogram"]
    assert len(histogram) == ADAPTIVE_DEFAULT_MAX_K + 1 and sum(histogram) >= 6
    assert 0 <= stats["adaptive_mean_chosen_k"] <= ADAPTIVE_DEFAULT_MAX_K
    costs = stats["adaptive_step_costs"]  # learned from the run's own steps (batch 4: bucket 4-7)
    assert costs["learned"] is True and 4 in costs["batch_sizes"] and stats["adaptive_timed_steps"] > 0
    assert stats["num_steps"] < 30
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_nothing_accepted_drives_k_to_zero_and_probes(qwen3_checkpoint, eagle3_head):
    llm = LLM(qwen3_checkpoint, speculative_config={
        "method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3, "adaptive": True,
        "simulate_acceptance": {"rates": [0.0, 0.0, 0.0]}}, **ENGINE)
    # The measured costs are what they are on this machine; make drafting clearly cost something
    # so that the choice follows acceptance, not timing noise.
    policy = llm.engine.adaptive
    policy.costs = StepCostModel((1,), ((1.0, 1.1, 1.2, 1.3),))
    llm.generate(["The cat"], greedy(150), use_tqdm=False)
    chosen = list(policy.recent)
    assert 0 in chosen[:8]
    late = chosen[40:]
    assert late.count(0) / len(late) > 0.8
    assert any(k > 0 for k in late)  # probes
    stats = llm.get_stats()
    assert stats["num_accepted_tokens"] == 0 and stats["num_drafts"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_trees_are_refused():
    with pytest.raises(ValueError, match="adaptive speculation sizes chains: it takes topk 1, got topk 2"):
        SpeculativeConfig(method="eagle3", model="head", num_speculative_tokens="auto", topk=2)


def test_bench_k_lists_take_auto():
    from foretell.bench.sweep import adaptive_counters, parse_k_list

    assert parse_k_list("1,3,auto") == [1, 3, "auto"]
    with pytest.raises(ValueError, match="auto twice"):
        parse_k_list("auto,2,auto")
    with pytest.raises(ValueError, match="'x' is not an integer"):
        parse_k_list("1,x")
    counters = adaptive_counters({"adaptive_chosen_k_histogram": [1, 0, 2]}, {"adaptive_chosen_k_histogram": [3, 0, 4]})
    assert counters == {"adaptive_chosen_k_histogram": [2, 0, 2], "adaptive_mean_chosen_k": 1.0}


def test_tensor_parallel_plans_carry_the_choice():
    from foretell.engine.scheduler import ScheduledSequence, SchedulerOutput
    from foretell.engine.sequence import Sequence
    from foretell.runner.step_plan import PlanEncoder, SequenceMirrors

    seq = Sequence(0, "r", 0, [1, 2, 3], SamplingParams(max_tokens=4), frozenset())
    sched = SchedulerOutput([ScheduledSequence(seq, 3, [], True)], num_next_drafts=2)
    assert SequenceMirrors().apply(PlanEncoder().encode(sched)).num_next_drafts == 2


def run_with_holes(policy: AdaptiveDraftLength, batch: int, steps: int, since_zero: list[int]) -> list[int]:
    """As run(), with a drafter whose KV cache has holes after a k = 0 step (an EAGLE3 head that
    skipped its catch-up): the first 8 drafting steps after a zero accept nothing, later ones all.
    since_zero[0] counts drafting steps since the last zero (-1: none yet), across calls."""
    chosen, drafts = [], 0
    for _ in range(steps):
        if drafts:
            for _ in range(batch):
                policy.observe(drafts, 0 if 0 <= since_zero[0] <= 8 else drafts)
        drafts = policy.choose(batch)
        if drafts == 0:
            since_zero[0] = 0
        elif since_zero[0] >= 0:
            since_zero[0] += 1
        chosen.append(drafts)
    return chosen


@pytest.mark.parametrize("holes_after_zero", [False, True])
def test_probes_over_a_holed_cache_do_not_pull_the_estimate_down(holes_after_zero):
    """Batch 64 prices drafts out (k = 0), batch 1 wants them; with skipped catch-ups the first
    drafting steps after a zero accept nothing. Observed, they drag the estimate down each time the
    batch shrinks again; ignored (holes_after_zero), the estimate stays what drafting accepts."""
    model = costs([1.0, 1.1, 1.2, 1.3, 1.4], growth=[1.0, 1.0, 30.0])
    policy = AdaptiveDraftLength(model, holes_after_zero=holes_after_zero)
    since_zero = [-1]
    run_with_holes(policy, 1, 40, since_zero)  # learns full acceptance at batch 1
    assert policy.stats()["adaptive_acceptance_estimate"][0] > 0.9
    first_rates = []
    for _ in range(4):  # the batch grows and shrinks: k = 0 at 64, then 8 drafting steps at batch 1
        assert run_with_holes(policy, 64, 20, since_zero)[-1] == 0
        assert run_with_holes(policy, 1, 8, since_zero)[0] > 0
        first_rates.append(policy.stats()["adaptive_acceptance_estimate"][0])
    stats = policy.stats()
    if holes_after_zero:
        assert min(first_rates) > 0.9, first_rates
        assert stats["adaptive_ignored_observations"] > 0
    else:
        assert min(first_rates) < 0.5, first_rates
        assert stats["adaptive_ignored_observations"] == 0
