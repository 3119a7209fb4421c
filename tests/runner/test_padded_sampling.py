"""Sampled rows on the padded verify step (issue 31, step 2b): rejection sampling over the step's
fixed-shape device tensors (spec_decode/rejection_sampler.sample_padded, verifier.sample_padded)
with counter-based noise keyed by each sequence's key and the positions on the device
(layers/sampler.py).

Checked here: the device row seeds equal the host's; for the same logits, drafts, draft
probabilities and seeds the padded form gives the host step's tokens (greedy and sampled rows
mixed, top-k / top-p, one-hot and sampled drafts, caps); its first emitted token follows the
target's distribution (chi-square); and in the engine (the CPU's eager padded step) sampled and
mixed batches take the padded step, queued ahead or not, with greedy outputs unchanged and seeded
outputs reproducible.
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.padded_step import count_steps
from foretell import LLM, SamplingParams
from foretell.layers.sampler import (
    UNIFORM_STREAM,
    NoiseSource,
    SamplingBatch,
    hashed_exponential,
    hashed_uniform,
    row_seed,
    row_seeds_on_device,
    sequence_key,
)
from foretell.runner.host_step import HostStep
from foretell.spec_decode.rejection_sampler import PaddedSampling
from foretell.spec_decode.verifier import ExactVerifier

CPU = torch.device("cpu")
PROMPTS = ["The cat reads the book. The cat", "a b a b a b a b", "Question: what", "The dog"]


def test_device_row_seeds_equal_the_hosts():
    keys = [(random.randrange(2**40), random.randrange(4)) for _ in range(20)]
    positions = [[random.randrange(10**6) for _ in range(5)] for _ in keys]
    device = row_seeds_on_device(torch.tensor([sequence_key(s, i) for s, i in keys]), torch.tensor(positions))
    assert device.tolist() == [[row_seed(s, i, p) for p in ps] for (s, i), ps in zip(keys, positions)]
    assert int(device.min()) >= 0


def test_hashed_noise_is_uniform_and_apart_per_row_and_stream():
    seeds = row_seeds_on_device(torch.tensor([sequence_key(7, 0)]), torch.arange(512)[None])[0]  # [512]
    u = hashed_uniform(seeds, 256, UNIFORM_STREAM)  # [512, 256]
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    counts = torch.histc(u.flatten(), 16, 0, 1)
    expected = u.numel() / 16
    assert float(((counts - expected) ** 2 / expected).sum()) < 45  # chi-square, 15 dof: p ~ 1e-4
    adjacent_rows = torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1]
    adjacent_columns = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]
    assert abs(float(adjacent_rows)) < 0.01 and abs(float(adjacent_columns)) < 0.01
    e = hashed_exponential(seeds, 256)
    assert abs(float(e.mean()) - 1) < 0.01 and not torch.equal(-torch.log(u), e)  # another stream


def _case(num_seqs: int, k: int, vocab: int, sampled_drafts: bool):
    """Random logits, drafts, per-sequence params (greedy and sampled, some with top-k / top-p,
    all seeded), and draft distributions (some sequences one-hot)."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    logits = torch.randn(num_seqs, k + 1, vocab, generator=gen) * 2
    params, probs, drafts = [], [], []
    for i in range(num_seqs):
        kind = i % 4
        params.append(SamplingParams(temperature=0.0 if kind == 0 else 0.9, top_k=5 if kind == 2 else 0,
                                     top_p=0.8 if kind == 3 else 1.0, seed=100 + i))
        if sampled_drafts and i % 2:
            q = torch.softmax(torch.randn(k, vocab, generator=gen), dim=-1)
            probs.append(q)
            drafts.append(torch.multinomial(q, 1, generator=gen).squeeze(1).tolist())
        else:
            probs.append(None)
            # Drafts often equal to the target's argmax, so that some are accepted.
            greedy = logits[i, :k].argmax(-1)
            noise = torch.randint(0, vocab, (k,), generator=gen)
            drafts.append(torch.where(torch.rand(k, generator=gen) < 0.6, greedy, noise).tolist())
    return logits, params, probs, drafts


@pytest.mark.parametrize("sampled_drafts", [False, True])
@pytest.mark.parametrize("with_caps", [False, True])
def test_padded_rejection_gives_the_host_steps_tokens(sampled_drafts, with_caps):
    num_seqs, k, vocab = 16, 3, 40
    logits, params, probs, drafts = _case(num_seqs, k, vocab, sampled_drafts)
    first_positions = [random.randrange(5, 500) for _ in range(num_seqs)]
    limits = [random.choice([None, 0, 1, 2]) if with_caps else None for _ in range(num_seqs)]
    verifier = ExactVerifier(NoiseSource(CPU, 0))

    # The host step: rows in order, each with its row seed (seed, sample index 0, its position).
    rows = [p for p in params for _ in range(k + 1)]
    seeds = [row_seed(p.seed, 0, first + r) for p, first in zip(params, first_positions) for r in range(k + 1)]
    host = verifier.verify(logits.reshape(-1, vocab), drafts, probs, SamplingBatch.build(rows, seeds, vocab, CPU),
                           limits)

    # The padded step: the same sequences as device tensors, keys and first positions.
    padded = PaddedSampling(SamplingBatch.build(rows, [None] * len(rows), vocab, CPU),
                            torch.tensor([sequence_key(p.seed, 0) for p in params]))
    dense = None
    if sampled_drafts:
        dense = torch.stack([torch.nn.functional.one_hot(torch.tensor(d), vocab).float() if q is None else q
                             for d, q in zip(drafts, probs)])
    caps = torch.tensor([k if limit is None else limit for limit in limits]) if with_caps else None
    accepted, next_token, num_live = torch.zeros(num_seqs + 2, dtype=torch.int64), torch.zeros(
        num_seqs + 2, dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    verifier.sample_padded(logits, logits.argmax(-1), torch.tensor(drafts), dense, padded,
                           torch.tensor(first_positions), caps, accepted, next_token, num_live)
    assert int(num_live) == num_seqs
    assert accepted[:num_seqs].tolist() == host.num_accepted
    assert [d[:a] + [t] for d, a, t in zip(drafts, accepted.tolist(), next_token.tolist())] == host.output_token_ids
    assert 0 < sum(host.num_accepted) < num_seqs * k  # some drafts accepted, some rejected


def _chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    keep = expected >= 5  # pool the rare tokens into one bin
    obs = torch.cat([observed[keep], observed[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    obs, exp = (obs, exp) if float(exp[-1]) >= 5 else (obs[:-1], exp[:-1])
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("drafts_from", ["argmax", "target_tail", "draft_distribution"])
def test_first_token_follows_the_target_distribution(drafts_from):
    """Many sequences of one target row and one draft setup, each with its own key: the first
    emitted token (the first draft if accepted, else the next token) follows p (temperature 0.8,
    top-p 0.95) whatever the drafts, deterministic (one-hot q) or drawn from q."""
    n, k, vocab = 6000, 2, 12
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    row_logits = torch.randn(k + 1, vocab, generator=gen) * 1.5
    logits = row_logits.expand(n, k + 1, vocab).contiguous()
    params = SamplingParams(temperature=0.8, top_p=0.95)
    rows = SamplingBatch.build([params] * (n * (k + 1)), [None] * (n * (k + 1)), vocab, CPU)
    from foretell.layers.sampler import processed_probs

    p0 = processed_probs(row_logits, SamplingBatch.build([params] * (k + 1), [None] * (k + 1), vocab, CPU))[0]
    dense = None
    if drafts_from == "argmax":
        drafts = row_logits[:k].argmax(-1).expand(n, k)
    elif drafts_from == "target_tail":  # a draft the target rarely picks: mostly rejected
        drafts = row_logits[:k].argmin(-1).expand(n, k)
    else:
        q = torch.softmax(torch.randn(k, vocab, generator=gen), dim=-1)  # [k, vocab]
        drafts = torch.multinomial(q, n, replacement=True, generator=gen).t()  # [n, k]
        dense = q.expand(n, k, vocab)
    keys = torch.tensor([sequence_key(random.randrange(2**40), 0) for _ in range(n)])
    first = torch.randint(0, 1000, (n,), generator=gen)
    accepted, next_token, num_live = (torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64),
                                      torch.zeros((), dtype=torch.int64))
    ExactVerifier(NoiseSource(CPU, 0)).sample_padded(logits, logits.argmax(-1), drafts.contiguous(), dense,
                                                     PaddedSampling(rows, keys), first, None, accepted,
                                                     next_token, num_live)
    first_token = torch.where(accepted > 0, drafts[:, 0], next_token)
    observed = torch.bincount(first_token, minlength=vocab).double()
    assert _chi_square_p_value(observed, p0.double() * n) > 1e-3


# ---- the engine -------------------------------------------------------------------------------



def test_sampled_and_mixed_batches_take_the_padded_step(qwen3_checkpoint, eagle3_head, monkeypatch):
    """Seeded sampled requests (with top-p / top-k) and a greedy one in one batch: verifies take
    the padded step (its first verify takes the host proposer's sampled drafts with their
    probabilities); queued ahead or not the tokens are the same, and the same again in a second
    engine; the greedy request's tokens equal the plain engine's."""
    counts = count_steps(monkeypatch)
    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3}
    params = [SamplingParams(temperature=0.8, max_tokens=14, seed=1, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, max_tokens=11, seed=2, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=20, max_tokens=14, seed=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)]
    got, runs = {}, [("off", 0), ("on", 1), ("on", 2)]
    for mode, run in runs:
        llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, max_num_seqs=4, async_scheduling=mode,
                  speculative_config=spec)
        kind = llm.engine.runner.pipeline.kinds[0]
        got[run] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert kind.num_sampled_steps > 0, mode
        if mode == "on":
            assert llm.engine.runner.pipeline.num_used > 0
        stats = llm.get_stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
        assert 0 < stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert got[0] == got[1] == got[2]
    assert [len(t) for t in got[0]] == [p.max_tokens for p in params]
    assert counts["padded"] > 0
    plain = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64)
    greedy = plain.generate(PROMPTS[3:], params[3:], use_tqdm=False)[0].outputs[0].token_ids
    assert got[0][3] == greedy


def test_a_sampled_batch_from_the_host_step_verifies_the_kept_draft_probabilities(qwen3_checkpoint, monkeypatch):
    """A draft model drafting for itself samples its drafts from the target's own distribution
    (q = p): every draft passes u * q < p, so a padded step that verifies them against the kept
    probabilities (not one-hot) accepts all of the first verify's drafts."""
    taken = []
    original = HostStep.take_draft_probs
    monkeypatch.setattr(HostStep, "take_draft_probs",
                        lambda self, item: taken.append(original(self, item)) or taken[-1])
    spec = {"method": "draft_model", "model": qwen3_checkpoint, "num_speculative_tokens": 3}
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, max_num_seqs=4, speculative_config=spec)
    params = SamplingParams(temperature=1.0, max_tokens=5, seed=5, ignore_eos=True)
    out = llm.generate(["The cat"], params, use_tqdm=False)[0].outputs[0].token_ids
    stats = llm.get_stats()
    assert len(out) == 5 and taken and taken[0] is not None and taken[0].shape[0] == 3
    assert stats["num_drafts"] == 1 and stats["num_accepted_tokens"] == 3  # prefill 1 + verify 3 + 1
