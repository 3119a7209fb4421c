"""The "auto" gate's StepCostBar (spec_decode/suffix_gate.py) against its reference
(tests/fixtures/suffix_gate_reference.py: the bookkeeping before it was made cheaper): random
engines' step sequences (batches that change and stay, sequences that sample or not, drafting runs,
plain stretches, slow and fast steps, several batch-size buckets, staleness, restarts) give the same
bar, the same `learned` and `explore` at every call, and the same costs at the end."""

from __future__ import annotations

import random

import pytest

from foretell.spec_decode import suffix_gate
from foretell.spec_decode.suffix_gate import StepCostBar
from tests.fixtures.suffix_gate_reference import ReferenceStepCostBar


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def drive(seed: int, num_calls: int, max_bar: float = 17.0, draft_probability: float = 0.6) -> None:
    rng = random.Random(seed)
    clock = Clock()
    new, ref = StepCostBar(max_bar, clock), ReferenceStepCostBar(max_bar, clock)
    batch = [1]
    next_id = 2
    for call in range(num_calls):
        r = rng.random()
        if r < 0.05:  # a request joins
            batch = batch + [next_id]
            next_id += 1
        elif r < 0.10 and len(batch) > 1:  # one leaves
            batch = batch[:rng.randrange(len(batch))] + batch[rng.randrange(len(batch)) + 1:]
        elif r < 0.12:  # a new batch of 1 to 40
            batch = list(range(next_id, next_id + rng.randint(1, 40)))
            next_id += len(batch)
        seq_ids = None if rng.random() < 0.01 else list(batch)
        samples = [rng.random() > 0.03 for _ in batch]
        got = new.begin_step(seq_ids, samples)
        want = ref.begin_step(seq_ids, samples)
        assert (got, new.bar, new.learned, new.explore) == (want, ref.bar, ref.learned, ref.explore), call
        drafted = (rng.random() < draft_probability) and not new.explore
        new.end_step(drafted)
        ref.end_step(drafted)
        # slow drafting steps, cheaper plain ones, now and then a spike (a shared machine)
        clock.now += rng.uniform(2e-3, 6e-3) if drafted else rng.uniform(0.5e-3, 1.5e-3)
        if rng.random() < 0.02:
            clock.now += rng.uniform(0, 50e-3)
        if rng.random() < 0.001:
            new.restart()
            ref.restart()
    assert new.num_intervals == ref.num_intervals
    assert sorted(new.buckets) == sorted(ref.buckets)
    for b, costs in new.buckets.items():
        other = ref.buckets[b]
        assert (costs.draft_s, costs.plain_s, costs.fallback_s, costs.run_length, costs.ratio) == (
            other.draft_s, other.plain_s, other.fallback_s, other.run_length, other.ratio)
    assert new.as_dict()["bars"] == [round(ref._bar(b), 4) for b in sorted(ref.buckets)]


@pytest.mark.parametrize("seed", range(6))
def test_the_gate_matches_its_reference_call_for_call(seed):
    drive(seed, 3000)


def test_stale_drafting_costs_are_dropped_as_the_reference_drops_them(monkeypatch):
    monkeypatch.setattr(suffix_gate, "DRAFT_STALE_AFTER", 40)
    from tests.fixtures import suffix_gate_reference

    monkeypatch.setattr(suffix_gate_reference, "DRAFT_STALE_AFTER", 40)
    for seed in range(3):
        drive(100 + seed, 2000, max_bar=4.0, draft_probability=0.1)
