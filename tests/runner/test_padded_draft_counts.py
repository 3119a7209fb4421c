"""The padded verify step with per-sequence draft counts and with no drafts (issue 31, 2b part 2).

A batch whose sequences verify different numbers of drafts (budget or length cuts, and every step
of adaptive speculation whose k differs from K) takes the padded step: each sequence's drafts are
padded to the step's q - 1 and acceptance stops at its own count (caps for greedy rows, lengths
for sampled rows: the bonus token from the sequence's own row). Under adaptive speculation the
step takes the graph of the chosen length (q = k + 1, 1..K + 1), k = 0 included (a padded decode
whose draft loop only catches the drafter up, or drafts when the next step wants drafts).

Checked here: for the same logits, drafts and seeds the padded form with mixed draft counts gives
the host step's tokens (greedy and sampled rows, one-hot and sampled drafts, caps); drawn
(simulated) acceptance of a shorter step stays within its drafts; in the engine (the CPU's eager
padded step, the same code as the captured one) mixed batches take the padded step with greedy
outputs equal to plain greedy decoding, queued ahead or not, for EAGLE3 and a draft LM; adaptive
runs take no host step but for prefills, including k = 0 steps; the draft loop drafts m of 0..K.
"""

from __future__ import annotations

import random

import pytest
import torch

from foretell import LLM, SamplingParams
from foretell.layers.sampler import NoiseSource, SamplingBatch, row_seed, sequence_key
from fixtures.padded_step import PROMPTS, force_adaptive_choices, fp32_engine, padded_kind, record_host_steps
from foretell.runner.decode_ahead import DecodeAhead
from foretell.runner.graphed_verify import GraphedVerify
from foretell.spec_decode.adaptive import StepCostModel
from foretell.spec_decode.rejection_sampler import PaddedSampling
from foretell.spec_decode.simulated_acceptance import SimulatedAcceptance
from foretell.spec_decode.verifier import ExactVerifier, SimulatedVerifier

CPU = torch.device("cpu")


def _outputs(n: int):
    i64 = dict(dtype=torch.int64)
    return torch.zeros(n + 2, **i64), torch.zeros(n + 2, **i64), torch.zeros((), **i64)


@pytest.mark.parametrize("sampled_drafts", [False, True])
@pytest.mark.parametrize("with_caps", [False, True])
def test_mixed_draft_counts_padded_give_the_host_steps_tokens(sampled_drafts, with_caps):
    """Sequences of 0..k drafts, padded to k: the padded verifier's tokens are the host
    verifier's for the unpadded lists (same logits rows, same row seeds)."""
    num_seqs, k, vocab = 24, 4, 30
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    lengths = [i % (k + 1) for i in range(num_seqs)]
    logits = torch.randn(num_seqs, k + 1, vocab, generator=gen) * 2  # [n, k + 1, vocab]; rows past a length unused
    params, drafts, probs, padded_drafts = [], [], [], []
    for i, n in enumerate(lengths):
        params.append(SamplingParams(temperature=0.0 if i % 3 == 0 else 0.9, top_k=6 if i % 3 == 2 else 0,
                                     seed=10 + i))
        if sampled_drafts and i % 2:
            q = torch.softmax(torch.randn(n, vocab, generator=gen), dim=-1)  # [n, vocab]
            probs.append(q)
            d = torch.multinomial(q, 1, generator=gen).squeeze(1).tolist() if n else []
        else:
            probs.append(None)
            d = [int(t) if random.random() < 0.7 else random.randrange(vocab) for t in logits[i, :n].argmax(-1)]
        drafts.append(d)
        padded_drafts.append(d + [0] * (k - n))
    first_positions = [random.randrange(3, 400) for _ in range(num_seqs)]
    limits = [random.choice([None, 0, 1, 3]) if with_caps else None for _ in range(num_seqs)]
    verifier = ExactVerifier(NoiseSource(CPU, 0))

    # The host step: each sequence's own n + 1 rows, in order, with their row seeds.
    host_rows = torch.cat([logits[i, : n + 1] for i, n in enumerate(lengths)])
    rows = [p for p, n in zip(params, lengths) for _ in range(n + 1)]
    seeds = [row_seed(p.seed, 0, first + r) for p, first, n in zip(params, first_positions, lengths)
             for r in range(n + 1)]
    host = verifier.verify(host_rows, drafts, probs, SamplingBatch.build(rows, seeds, vocab, CPU), limits)

    # The padded step: k + 1 rows per sequence, caps = min(limit, length), lengths for sampled rows.
    padded_rows = [p for p in params for _ in range(k + 1)]
    sampling = PaddedSampling(SamplingBatch.build(padded_rows, [None] * len(padded_rows), vocab, CPU),
                              torch.tensor([sequence_key(p.seed, 0) for p in params]))
    dense = None
    if sampled_drafts:
        dense = torch.zeros(num_seqs, k, vocab)
        for i, (d, q) in enumerate(zip(drafts, probs)):
            if d:
                dense[i, : len(d)] = torch.nn.functional.one_hot(torch.tensor(d), vocab).float() if q is None else q
    caps = torch.tensor([n if limit is None else min(n, limit) for n, limit in zip(lengths, limits)])
    accepted, next_token, num_live = _outputs(num_seqs)
    verifier.sample_padded(logits, logits.argmax(-1), torch.tensor(padded_drafts), dense, sampling,
                           torch.tensor(first_positions), caps, accepted, next_token, num_live,
                           torch.tensor(lengths))
    assert int(num_live) == num_seqs
    assert accepted[:num_seqs].tolist() == host.num_accepted
    assert [d[:a] + [t] for d, a, t in zip(drafts, accepted.tolist(), next_token.tolist())] == host.output_token_ids
    assert all(a <= n for a, n in zip(host.num_accepted, lengths))


def test_drawn_acceptance_of_a_shorter_step_stays_within_its_drafts():
    """A simulated verifier of K = 4 on a step verifying 2 drafts: counts are those of the first
    two rates (never past the step's drafts), and its next token is the target's at that row."""
    rates = [0.99, 0.99, 0.99, 0.99]
    verifier = SimulatedVerifier(SimulatedAcceptance(rates, 0), NoiseSource(CPU, 0))
    n = 16
    greedy = torch.arange(n * 3).view(n, 3)  # [n, q = 3]
    accepted, next_token, num_live = _outputs(n)
    verifier.accept_padded(greedy, None, None, accepted, next_token, num_live)
    assert accepted[:n].max() <= 2 and accepted[:n].sum() > n  # almost all accept both
    assert next_token[:n].tolist() == greedy.gather(1, accepted[:n, None]).squeeze(1).tolist()
    greedy = torch.arange(n)[:, None]  # a step of no drafts: nothing accepted, the target's token
    verifier.accept_padded(greedy, None, None, accepted, next_token, num_live)
    assert accepted[:n].tolist() == [0] * n and next_token[:n].tolist() == list(range(n))


# ---- the engine -------------------------------------------------------------------------------

def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def plain_greedy(checkpoint, prompts, n: int) -> list[list[int]]:
    llm = fp32_engine(checkpoint)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(n), use_tqdm=False)]


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
@pytest.mark.parametrize("mode", ["off", "on"])
def test_mixed_draft_counts_take_the_padded_step(qwen3_checkpoint, eagle3_head, monkeypatch, method, mode):
    """A step budget that cuts the last sequence's drafts (4 sequences x 4 rows > 14 tokens):
    every verify takes the padded step, mixed ones included, and greedy output equals plain."""
    steps = record_host_steps(monkeypatch)
    spec = {"method": method, "model": eagle3_head if method == "eagle3" else qwen3_checkpoint,
            "num_speculative_tokens": 3}
    llm = fp32_engine(qwen3_checkpoint, max_num_batched_tokens=14, async_scheduling=mode, speculative_config=spec)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(48), use_tqdm=False)]
    assert all(steps), "a verify batch without prefill rows took the host step"
    assert got == plain_greedy(qwen3_checkpoint, PROMPTS, 48)
    kind = padded_kind(llm)
    assert isinstance(kind, GraphedVerify) and kind.num_mixed_steps > 0 and kind.num_steps > kind.num_mixed_steps
    if mode == "on":
        assert llm.engine.runner.pipeline.num_used > 0
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_seeded_sampling_near_max_tokens_takes_the_padded_step(qwen3_checkpoint, eagle3_head, monkeypatch):
    """Sampled requests near max_tokens verify fewer drafts than the others (the scheduler cuts a
    sampled request's drafts there): those steps stay padded, and the run is reproducible."""
    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3}
    params = [SamplingParams(temperature=0.8, max_tokens=n, seed=i, ignore_eos=True)
              for i, n in enumerate((9, 10, 12, 13))]
    runs = []
    for _ in range(2):
        steps = record_host_steps(monkeypatch)
        llm = fp32_engine(qwen3_checkpoint, speculative_config=spec)
        runs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
        kind = padded_kind(llm)
        assert kind.num_mixed_steps > 0 and kind.num_sampled_steps > 0 and all(steps)
    assert runs[0] == runs[1] and [len(t) for t in runs[0]] == [9, 10, 12, 13]


def adaptive_llm(qwen3_checkpoint, drafter: dict, mode: str, **spec) -> LLM:
    return fp32_engine(qwen3_checkpoint, async_scheduling=mode,
                       speculative_config={**drafter, "num_speculative_tokens": 3, "adaptive": True, **spec})


@pytest.mark.parametrize("mode", ["off", "on"])
def test_adaptive_runs_take_no_host_step_after_prefill(qwen3_checkpoint, eagle3_head, monkeypatch, mode):
    """Adaptive speculation with every k in 0..3 chosen in turn (a policy cycling through them):
    verify and k = 0 steps all take the padded step (queued ahead, a k = 0 step whose next step
    drafts nothing is decoded plainly: no drafter runs there); greedy output equals plain."""
    llm = adaptive_llm(qwen3_checkpoint, {"method": "eagle3", "model": eagle3_head}, mode)
    force_adaptive_choices(monkeypatch, llm, [3, 1, 0, 0, 2, 3, 0, 1])
    steps = record_host_steps(monkeypatch)
    kind = padded_kind(llm)
    before = kind.num_steps  # the start-up measurement's steps
    loops = []
    run = type(llm.engine.runner.draft_graphs).run
    monkeypatch.setattr(type(llm.engine.runner.draft_graphs), "run",
                        lambda self, bucket, n, q=None, m=None: loops.append((q, m)) or run(self, bucket, n, q, m))
    plain = []  # per k = 0 step launched from host inputs as a plain decode step (queued ahead only)
    launch = DecodeAhead.launch

    def plain_launch(self, sched, batch):
        step = launch(self, sched, batch)
        if step is not None:
            plain.append(sched.num_next_drafts)
        return step

    monkeypatch.setattr(DecodeAhead, "launch", plain_launch)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(20), use_tqdm=False)]
    assert all(steps), "a batch without prefill rows took the host step"
    assert got == plain_greedy(qwen3_checkpoint, PROMPTS, 20)
    lengths = {q for q, _ in loops}
    # Every verify length, k = 0 included (queued ahead, a step drafts what the one before it chose,
    # so a growing k is taken one step late: some lengths of the cycle may not be reached).
    assert lengths == {1, 2, 3, 4} if mode == "off" else {1, 4} <= lengths and len(lengths) >= 3
    assert any(m == 3 for _, m in loops)  # K drafts for a growing k
    # a k = 0 step whose next drafts nothing: a padded decode running no drafter, or queued ahead a plain decode
    assert (1, 0) in loops if mode == "off" else (plain and set(plain) == {0})
    assert kind.num_steps - before == len(loops)
    if mode == "on":
        assert llm.engine.runner.pipeline.num_used > 0
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_adaptive_k_zero_with_a_draft_lm_stays_padded(qwen3_checkpoint, monkeypatch):
    """Nothing accepted (simulated): k falls to 0 and stays there but for probes; the k = 0 steps
    of a draft LM (two catch-up rows per sequence) take the padded step."""
    llm = adaptive_llm(qwen3_checkpoint, {"method": "draft_model", "model": qwen3_checkpoint}, "on",
                       simulate_acceptance={"rates": [0.0, 0.0, 0.0]})
    llm.engine.adaptive.costs = StepCostModel((1,), ((1.0, 1.1, 1.2, 1.3),))
    steps = record_host_steps(monkeypatch)
    kind = padded_kind(llm)
    llm.generate(["The cat"], greedy(40), use_tqdm=False)
    assert all(steps) and kind.num_steps > 30
    assert list(llm.engine.adaptive.recent)[-20:].count(0) > 10
    stats = llm.get_stats()
    assert stats["num_accepted_tokens"] == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_draft_loop_keys_and_bad_verify_lengths(qwen3_checkpoint, eagle3_head):
    """The loops per (q, m); with adaptive_skip_catch_up (the default) no m = 0 loop, and a step
    whose next step drafts nothing drafts 0 whatever it verified."""
    llm = adaptive_llm(qwen3_checkpoint, {"method": "eagle3", "model": eagle3_head}, "off",
                       adaptive_skip_catch_up=False)
    loop = llm.engine.runner.draft_graphs
    assert loop.verify_lens == (1, 2, 3, 4)
    assert loop.loop_keys() == [(1, 0), (1, 3), (2, 1), (2, 3), (3, 2), (3, 3), (4, 3)]
    kind = padded_kind(llm)
    cases = ((1, 0), (1, 2), (3, 0), (3, 1), (3, 2), (3, 3), (4, None))
    assert [kind.num_drafts(q, k) for q, k in cases] == [0, 3, 2, 2, 2, 3, 3]
    loop.skip_catch_up = True
    assert loop.loop_keys() == [(1, 3), (2, 1), (2, 3), (3, 2), (3, 3), (4, 3)]
    assert [kind.num_drafts(q, k) for q, k in cases] == [0, 3, 0, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="verify lengths must lie in 1..4"):
        type(loop)(loop.proposer, loop.target, 3, verify_lens=(5,))
