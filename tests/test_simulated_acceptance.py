"""Simulated acceptance: per-position rates or a mean length are honoured, the output is marked
synthetic, and bad settings are refused."""

from __future__ import annotations

import pytest

from foretell import LLM, SamplingParams
from foretell.spec_decode.simulated_acceptance import rates_from_config


def test_mean_length_gives_rates_with_that_mean():
    rates = rates_from_config({"mean_acceptance_length": 2.93}, 3)
    assert 1 + sum(rates) == pytest.approx(2.93, abs=1e-6)
    assert rates == sorted(rates, reverse=True)


@pytest.mark.parametrize(
    "spec",
    [{"rates": [0.5, 0.7, 0.1]}, {"rates": [0.5]}, {"mean_acceptance_length": 5}, {"foo": 1}, {}],
)
def test_bad_settings_are_refused(spec):
    with pytest.raises(ValueError, match="simulate_acceptance"):
        rates_from_config(spec, 3)


def test_engine_draws_acceptance_at_the_given_rates(qwen3_checkpoint, eagle3_head):
    rates = [0.9, 0.6, 0.3]
    llm = LLM(qwen3_checkpoint, num_kv_blocks=256, speculative_config={
        "method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3,
        "simulate_acceptance": {"rates": rates}})
    llm.generate(["The cat"] * 8, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    stats = llm.get_stats()
    assert stats["synthetic_acceptance"] is True
    for measured, wanted in zip(stats["acceptance_per_position"], rates):
        assert measured == pytest.approx(wanted, abs=0.08)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
