"""The verifier chosen at build time (spec_decode/verifier.py) and the method table
(spec_decode/registry.py), on their own:
- exact verification from host lists follows the greedy definition row by row (longest prefix of
  drafts equal to the target's argmax, then the target's token), for any mix of draft counts,
  with acceptance limits, also for the greedy sequences of a batch that samples others;
- simulated acceptance draws the same counts in its host form and in its padded device form (one
  sequence of draws shared by both), capped at each sequence's own drafts, and its next token is
  the target's greedy token at that row;
- verify_greedy (the greedy rows' tokens instead of their logits, as tensor parallelism hands
  them) gives what verify gives on those logits, for both verifiers;
- build_verifier and build_proposer pick from the config, with clear errors.
"""

from __future__ import annotations

import random

import pytest
import torch

from foretell.speculative_config import SPECULATIVE_METHODS, SpeculativeConfig
from foretell.layers.sampler import NoiseSource, SamplingBatch
from foretell.sampling_params import SamplingParams
from foretell.spec_decode.ngram import NgramProposer
from foretell.spec_decode.registry import PROPOSERS, build_proposer
from foretell.spec_decode.simulated_acceptance import SimulatedAcceptance
from foretell.spec_decode.verifier import ExactVerifier, SimulatedVerifier, build_verifier

CPU = torch.device("cpu")
VOCAB = 11


def greedy_logits(rng: random.Random, drafts: list[list[int]]) -> tuple[torch.Tensor, list[list[int]]]:
    """Logits rows (k_i + 1 per sequence) whose argmax agrees with the drafts for a random prefix;
    and each row's argmax."""
    rows, argmax = [], []
    for d in drafts:
        agree = rng.randrange(len(d) + 1)
        tokens = [d[i] if i < agree else rng.randrange(VOCAB) for i in range(len(d) + 1)]
        argmax.append(tokens)
        for t in tokens:
            row = torch.randn(VOCAB)
            row[t] = 10.0
            rows.append(row)
    return torch.stack(rows), argmax


def batch_of(params: list[SamplingParams], drafts: list[list[int]]) -> SamplingBatch:
    row_params = [p for p, d in zip(params, drafts) for _ in range(len(d) + 1)]
    return SamplingBatch.build(row_params, [None] * len(row_params), VOCAB, CPU)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_verification_follows_the_greedy_definition(seed):
    rng = random.Random(seed)
    drafts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4))] for _ in range(7)]
    logits, argmax = greedy_logits(rng, drafts)
    limits = [rng.choice([None, 0, 1, 2]) for _ in drafts]
    greedy = SamplingParams(temperature=0)
    out = ExactVerifier(NoiseSource(CPU, 0)).verify(logits, drafts, [None] * len(drafts),
                                                    batch_of([greedy] * len(drafts), drafts), limits)
    for d, target, limit, accepted, tokens in zip(drafts, argmax, limits, out.num_accepted, out.output_token_ids):
        agree = 0
        while agree < len(d) and d[agree] == target[agree]:
            agree += 1
        if limit is not None and agree > limit:  # capped: the accepted drafts up to the limit + 1
            assert accepted == limit and tokens == d[: limit + 1]
        else:
            assert accepted == agree and tokens == d[:agree] + [target[agree]]


def test_greedy_sequences_of_a_sampled_batch_follow_the_definition():
    rng = random.Random(5)
    drafts = [[rng.randrange(VOCAB) for _ in range(3)] for _ in range(6)]
    logits, argmax = greedy_logits(rng, drafts)
    params = [SamplingParams(temperature=0) if i % 2 == 0 else SamplingParams(temperature=0.8) for i in range(6)]
    out = ExactVerifier(NoiseSource(CPU, 0)).verify(logits, drafts, [None] * 6, batch_of(params, drafts), [None] * 6)
    for i in range(0, 6, 2):
        d, target = drafts[i], argmax[i]
        agree = 0
        while agree < 3 and d[agree] == target[agree]:
            agree += 1
        assert out.num_accepted[i] == agree and out.output_token_ids[i] == d[:agree] + [target[agree]]


@pytest.mark.parametrize("num_seqs", [1, 5])
def test_simulated_host_and_padded_forms_draw_the_same_counts(num_seqs):
    rates = [0.9, 0.6, 0.3]
    k = len(rates)
    rng = random.Random(num_seqs)
    host = SimulatedVerifier(SimulatedAcceptance(rates, seed=4), NoiseSource(CPU, 0))
    padded = SimulatedVerifier(SimulatedAcceptance(rates, seed=4), NoiseSource(CPU, 0))
    greedy = SamplingParams(temperature=0)
    for step in range(40):
        drafts = [[rng.randrange(VOCAB) for _ in range(k)] for _ in range(num_seqs)]
        logits, argmax = greedy_logits(rng, drafts)
        out = host.verify(logits, drafts, [None] * num_seqs, batch_of([greedy] * num_seqs, drafts),
                          [None] * num_seqs)
        accepted = torch.zeros(num_seqs, dtype=torch.int64)
        next_token = torch.zeros(num_seqs, dtype=torch.int64)
        num_live = torch.zeros((), dtype=torch.int64)
        padded.accept_padded(torch.tensor(argmax), torch.tensor(drafts), None, accepted, next_token, num_live)
        assert out.num_accepted == accepted.tolist(), step
        assert [tokens[-1] for tokens in out.output_token_ids] == next_token.tolist()
        for d, a, target, tokens in zip(drafts, out.num_accepted, argmax, out.output_token_ids):
            assert tokens == d[:a] + [target[a]]  # drawn, not verified: the drafts are taken as they are


def test_simulated_counts_are_capped_at_each_sequences_drafts():
    verifier = SimulatedVerifier(SimulatedAcceptance([1.0, 1.0, 1.0], seed=0), NoiseSource(CPU, 0))
    drafts = [[1, 2, 3], [4], [], [5, 6]]
    logits, argmax = greedy_logits(random.Random(0), drafts)
    out = verifier.verify(logits, drafts, [None] * 4, batch_of([SamplingParams(temperature=0)] * 4, drafts),
                          [None, None, None, 1])
    assert out.num_accepted == [3, 1, 0, 1]
    assert out.output_token_ids == [[1, 2, 3, argmax[0][3]], [4, argmax[1][1]], [argmax[2][0]], [5, 6]]


@pytest.mark.parametrize("simulated", [False, True], ids=["exact", "simulated"])
def test_verify_greedy_from_tokens_equals_verify_from_logits(simulated):
    rng = random.Random(3)

    def build():
        if simulated:
            return SimulatedVerifier(SimulatedAcceptance([0.9, 0.6, 0.3], seed=2), NoiseSource(CPU, 0))
        return ExactVerifier(NoiseSource(CPU, 0))

    from_logits, from_tokens = build(), build()
    greedy = SamplingParams(temperature=0)
    for _ in range(10):
        drafts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4))] for _ in range(5)]
        drafts[0] = drafts[0] or [rng.randrange(VOCAB)]  # a verify step: some sequence has drafts
        logits, argmax = greedy_logits(rng, drafts)
        limits = [rng.choice([None, 0, 1, 2]) for _ in drafts]
        expected = from_logits.verify(logits, drafts, [None] * 5, batch_of([greedy] * 5, drafts), limits)
        tokens = torch.tensor([t for row in argmax for t in row])  # [rows] int64
        out = from_tokens.verify_greedy(tokens, drafts, limits)
        assert (out.num_accepted, out.output_token_ids, out.emitted_rows) == (
            expected.num_accepted, expected.output_token_ids, expected.emitted_rows)
        assert out.emitted_tokens.tolist() == expected.emitted_tokens.tolist()


def test_build_verifier_picks_from_the_config():
    noise = NoiseSource(CPU, 0)
    assert not build_verifier(None, noise, 0).synthetic
    plain = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert isinstance(build_verifier(plain, noise, 0), ExactVerifier)
    simulated = SpeculativeConfig(method="ngram", num_speculative_tokens=2,
                                  simulate_acceptance={"mean_acceptance_length": 2.0})
    verifier = build_verifier(simulated, noise, 0)
    assert isinstance(verifier, SimulatedVerifier) and verifier.synthetic
    bad = SpeculativeConfig(method="ngram", num_speculative_tokens=2, simulate_acceptance={"rates": [0.5]})
    with pytest.raises(ValueError, match="simulate_acceptance rates must be 2"):
        build_verifier(bad, noise, 0)


def test_every_method_has_a_proposer_class_and_unknown_ones_are_refused():
    assert sorted(PROPOSERS) == sorted(SPECULATIVE_METHODS)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    proposer = build_proposer(config, None, None)
    assert isinstance(proposer, NgramProposer) and proposer.k == 2
    assert proposer.capabilities.deterministic and proposer.padded_drafter() is None
    assert proposer.capabilities.aux_hidden_state_layers == () and proposer.kv_layers() == []
    config.method = "medusa"  # past validation, as a stale config object could be
    with pytest.raises(ValueError, match="'medusa' is not available; available: \\['draft_model', 'eagle3'"):
        build_proposer(config, None, None)
