"""Simulated acceptance: per-position rates or a mean length are honoured, the output is marked
synthetic, and bad settings are refused."""

from __future__ import annotations

import pytest

from foretell import LLM, SamplingParams
import torch

from foretell.spec_decode.simulated_acceptance import SimulatedAcceptance, rates_from_config


def test_mean_length_gives_rates_with_that_mean():
    rates = rates_from_config({"mean_acceptance_length": 2.93}, 3)
    assert 1 + sum(rates) == pytest.approx(2.93, abs=1e-6)
    assert rates == sorted(rates, reverse=True)


@pytest.mark.parametrize("seed", [0, 1, 7, 42])
def test_a_short_run_realizes_the_asked_mean(seed):
    """43 draws (one 128-token request at 2.93) land near the asked mean: independent draws
    spread by about +-0.36 (two standard deviations) there."""
    rates = rates_from_config({"mean_acceptance_length": 2.93}, 3)
    draws = SimulatedAcceptance(rates, seed)
    counts = torch.cat([draws.accepted_counts(1, torch.device("cpu")) for _ in range(43)])
    assert 1 + counts.double().mean().item() == pytest.approx(2.93, abs=0.1)


@pytest.mark.parametrize("batch", [4, 16, 64])
def test_each_sequence_of_a_batch_realizes_the_asked_mean(batch):
    rates = rates_from_config({"mean_acceptance_length": 2.93}, 3)
    draws = SimulatedAcceptance(rates, seed=0)
    counts = torch.stack([draws.accepted_counts(batch, torch.device("cpu")) for _ in range(43)])  # [steps, batch]
    per_sequence = 1 + counts.double().mean(dim=0)
    assert per_sequence.min().item() > 2.8 and per_sequence.max().item() < 3.06
    per_step = 1 + counts.double().mean(dim=1)  # a step's sequences spread over the distribution
    assert (per_step - 2.93).abs().max().item() < {4: 1.0, 16: 0.3, 64: 0.1}[batch]


def test_draws_meet_every_position_rate_and_both_paths_share_them():
    rates = [0.9, 0.6, 0.3]
    host = SimulatedAcceptance(rates, seed=3)
    device = SimulatedAcceptance(rates, seed=3)
    batches = [1, 4, 3] * 100
    uniforms = [u for n in batches for u in host.uniforms(n)]
    assert all(0 <= u < 1 for u in uniforms)
    counts = torch.cat([device.accepted_counts(n, torch.device("cpu")) for n in batches])
    assert counts.tolist() == [sum(u < r for r in rates) for u in uniforms]  # the same draws on either path
    for j, rate in enumerate(rates, start=1):
        assert (counts >= j).double().mean().item() == pytest.approx(rate, abs=0.01)  # independent: +-0.03


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
