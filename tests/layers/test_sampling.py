"""Sampling against exact distributions: the sampler's truncation (top-k, top-p, min-p) against a
float64 computation, its draws against that distribution, and the rejection sampler's output
distribution against the target's (lossless), with a random draft and with draft == target."""

from __future__ import annotations

import pytest
import torch

from foretell.layers.sampler import NoiseSource, Sampler, SamplingBatch, processed_probs
from foretell.sampling_params import SamplingParams
from foretell.spec_decode.rejection_sampler import RejectionSampler

VOCAB = 8


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """float64, written directly from the definitions, one row."""
    probs = torch.softmax(logits.double() / p.temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, token in enumerate(order.tolist()):
        if p.top_k > 0 and rank >= p.top_k:
            break
        if rank > 0 and mass >= p.top_p:
            break
        keep[token] = True
        mass += probs[token].item()
    probs = torch.where(keep, probs, 0.0)
    probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05),
]


def batch_for(params, n_rows, seeds=None):
    return SamplingBatch.build([params] * n_rows, seeds or [None] * n_rows, VOCAB, torch.device("cpu"))


@pytest.mark.parametrize("params", PARAMS)
def test_processed_probs_match_float64_reference(params):
    logits = torch.randn(4, VOCAB) * 2
    got = processed_probs(logits, batch_for(params, 4))
    for row in range(4):
        torch.testing.assert_close(got[row].double(), reference_probs(logits[row], params), atol=1e-6, rtol=1e-5)


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


@pytest.mark.parametrize("params", PARAMS)
def test_sampler_draws_follow_the_distribution(params):
    n = 40000
    logits = (torch.randn(VOCAB) * 1.5).expand(n, VOCAB).contiguous()
    sampler = Sampler(NoiseSource(torch.device("cpu"), seed=1))
    tokens = sampler(logits, batch_for(params, n)).token_ids
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    expected = reference_probs(logits[0], params)
    assert counts[expected == 0].sum() == 0  # truncated tokens never appear
    assert total_variation(counts, expected) < 0.015


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    logits = torch.randn(3, VOCAB)
    params = SamplingParams(temperature=1.0, seed=42)
    a = Sampler(NoiseSource(torch.device("cpu"), 0))(logits, batch_for(params, 3, [11, 12, 13])).token_ids
    b = Sampler(NoiseSource(torch.device("cpu"), 9))(logits[1:], batch_for(params, 2, [12, 13])).token_ids
    assert a[1:].tolist() == b.tolist()


@pytest.mark.parametrize("draft_equals_target", [False, True])
@pytest.mark.parametrize("params", [PARAMS[0], PARAMS[4]])
def test_rejection_sampling_is_lossless(params, draft_equals_target):
    """Over many independent sequences with k = 2 drafts drawn from q: the first and second
    emitted tokens follow the target's distributions p_0 and (given the first) p_1."""
    torch.manual_seed(0)
    n, k = 30000, 2
    target_logits = torch.randn(k + 1, VOCAB) * 1.5
    p = processed_probs(target_logits, batch_for(params, k + 1))
    q = p[:k].clone() if draft_equals_target else torch.softmax(torch.randn(k, VOCAB) * 1.5, -1)
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True) for i in range(k)], 1)  # [n, k]
    logits = target_logits.repeat(n, 1)  # [(k + 1) * n, vocab]
    sampler = RejectionSampler(NoiseSource(torch.device("cpu"), seed=3))
    result = sampler(logits, drafts.tolist(), [q] * n, batch_for(params, (k + 1) * n))
    first = torch.tensor([out[0] for out in result.output_token_ids])
    assert total_variation(torch.bincount(first, minlength=VOCAB).double(), p[0].double()) < 0.015
    # Second token, among sequences whose first token was the draft's (row 1 is then p_1).
    kept = [out[1] for out, d in zip(result.output_token_ids, drafts.tolist()) if len(out) > 1 and out[0] == d[0]]
    assert total_variation(torch.bincount(torch.tensor(kept), minlength=VOCAB).double(), p[1].double()) < 0.03
    if draft_equals_target:
        assert sum(result.num_accepted) > 0.999 * n * k


def test_greedy_verification_accepts_the_matching_prefix():
    logits = torch.full((4, VOCAB), -5.0)
    for row, token in enumerate([3, 1, 4, 6]):
        logits[row, token] = 5.0
    sampler = RejectionSampler(NoiseSource(torch.device("cpu"), 0))
    batch = batch_for(SamplingParams(temperature=0), 4)
    out = sampler(logits, [[3, 1, 5]], [None], batch)
    assert out.num_accepted == [2] and out.output_token_ids == [[3, 1, 4]]
    out = sampler(logits, [[3, 1, 4]], [None], batch)
    assert out.num_accepted == [3] and out.output_token_ids == [[3, 1, 4, 6]]  # bonus token
