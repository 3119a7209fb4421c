"""processed_probs gives a row the same bits alone and among other rows, truncated or not (issue 23).

It used to renormalise with probs / probs.sum(dim=-1): on CUDA torch sizes a row reduction's thread
block by the number of rows (512 threads on one row, 32 on each of 64), so a seeded request sampled
alone and in a batch of 64 drew from other bits (56 of 64 equal on the H200). Now a truncated row is
the softmax of its kept logits (the softmax kernel runs one block per row, sized by the vocabulary),
and an untruncated row is softmax(logits / T) itself, with no renormalisation at all.
"""

from __future__ import annotations

import torch

from foretell.layers.sampler import SamplingBatch, processed_probs
from foretell.sampling_params import SamplingParams

VOCAB = 300
PARAMS = [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.3, top_k=7),
    SamplingParams(temperature=0.7, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.01),
]


def probs_of(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    batch = SamplingBatch.build(params, [None] * len(params), VOCAB, logits.device)
    return processed_probs(logits, batch)


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:  # [vocab] float64
    """The truncated, renormalised distribution in float64, from its definition."""
    if p.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(), VOCAB).double()
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.ones(VOCAB, dtype=torch.bool)
    if p.top_k > 0:
        keep[order[p.top_k :]] = False
    before = probs[order].cumsum(0) - probs[order]
    keep[order[before >= p.top_p]] = False
    keep[order[0]] = True
    keep &= probs >= p.min_p * probs.max()
    kept = probs * keep
    return kept / kept.sum()


def test_a_row_alone_equals_the_row_among_others():
    gen = torch.Generator().manual_seed(23)
    logits = torch.randn(len(PARAMS), VOCAB, generator=gen) * 3  # [rows, vocab] float32
    together = probs_of(logits, PARAMS)
    for r, p in enumerate(PARAMS):
        if p.temperature > 0:  # (an all-greedy batch never samples: the Sampler takes its argmax)
            assert torch.equal(probs_of(logits[r : r + 1].clone(), [p]), together[r : r + 1]), f"row {r}"
        assert torch.equal(probs_of(logits[[0, r]].clone(), [PARAMS[0], p])[1:], together[r : r + 1]), f"row {r} of 2"
    shuffled = [5, 3, 0, 4, 1, 2]
    assert torch.equal(probs_of(logits[shuffled], [PARAMS[i] for i in shuffled]), together[shuffled])


def test_untruncated_rows_are_the_softmax_itself_and_truncated_rows_the_renormalised_distribution():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(len(PARAMS), VOCAB, generator=gen) * 3
    probs = probs_of(logits, PARAMS)
    assert torch.equal(probs[0], torch.softmax(logits[0] / 0.8, dim=-1))  # no renormalising division
    for r, p in enumerate(PARAMS):
        want = reference(logits[r], p)
        assert torch.equal(probs[r] > 0, want > 0), f"row {r}: another set of tokens kept"
        torch.testing.assert_close(probs[r].double(), want, rtol=1e-5, atol=1e-7)
    assert torch.allclose(probs.double().sum(dim=-1), torch.ones(len(PARAMS), dtype=torch.float64), atol=1e-6)


def test_top_p_one_keeps_every_token_though_the_cumsum_passes_one():
    """A row without top-p (1.0) beside a truncated row keeps its whole softmax: its float32 cumsum
    of sorted probabilities passes 1.0 before the tail on many rows (20 seeds here; how often
    depends on the CPU's vector width), which cut tail tokens of untruncated rows."""
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=5)]
    for seed in range(20):
        logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
        probs = probs_of(logits, params)
        assert bool((probs[0] > 0).all()), f"seed {seed}: tokens cut from a row without top-p"
        torch.testing.assert_close(probs[0], torch.softmax(logits[0], dim=-1), rtol=0, atol=0)
