"""Logprobs on the padded verify step (issue 31, one speculative step).

A request with `logprobs` no longer leaves the padded step: after verification the device takes
the log-softmax of the target's raw logits at every verify row, the top-n, and the log-prob of the
token each row emits, and the values come back in the step's one read-back
(runner/logprobs.py's padded_step_logprobs / read_padded_logprobs; runner/graphed_verify.py).

Checked here: for the same logits and verification results the padded form gives exactly what the
host step's add_logprobs gives (mixed top-n, sequences without logprobs, k = 0, accepted counts
0..k); in the engine (the CPU's eager padded step, the same code as the captured one) batches with
logprobs take the padded step, queued ahead or not, and their logprobs equal an independent
reference: plain decoding on the host step (greedy), or the target scoring the generated tokens as
a prompt (seeded sampling); adding logprobs leaves a seeded request's tokens as they were; k = 0
steps of adaptive speculation, a request without speculation in the batch, and acceptance capped
near max_tokens; bad top-n values still fail with their clear errors.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from foretell import LLM, SamplingParams
from foretell.engine.scheduler import ScheduledSequence, SchedulerOutput
from foretell.engine.sequence import Sequence
from foretell.layers.sampler import SamplingBatch
from fixtures.padded_step import (
    PROMPTS,
    force_adaptive_choices,
    fp32_engine,
    padded_kind,
    record_host_steps,
    record_verify_lengths,
)
from foretell.runner.graphed_verify import GraphedVerify
from foretell.runner.logprobs import (
    PaddedLogprobs,
    add_logprobs,
    emitted_row_tokens,
    padded_step_logprobs,
    read_padded_logprobs,
)

CPU = torch.device("cpu")
TOLERANCE = 1e-5


# ---- the padded form against the host step's, for the same logits ----------------------------

def _host_logprobs(logits, drafts, accepted, next_token, wants):
    """The host step's add_logprobs over the emitted rows (row j of sequence i at i * q + j)."""
    n, q, vocab = logits.shape
    params = [SamplingParams(temperature=0.0, logprobs=w) for w in wants]
    sampling = SamplingBatch.build(params, [None] * n, vocab, CPU)
    results = [SimpleNamespace(new_token_ids=drafts[i][: accepted[i]] + [next_token[i]], logprobs=[])
               for i in range(n)]
    rows = [i * q + j for i in range(n) for j in range(accepted[i] + 1)]
    tokens = torch.tensor([t for r in results for t in r.new_token_ids])
    sched = SimpleNamespace(scheduled=[SimpleNamespace(seq=SimpleNamespace(sampling_params=p)) for p in params])
    batch = SimpleNamespace(sampling_seq_index=list(range(n)))
    add_logprobs(logits.reshape(n * q, vocab), torch.tensor(rows), tokens, sampling, batch, sched, results)
    return [r.logprobs for r in results], [r.new_token_ids for r in results]


def _assert_same_logprobs(got, expected, tolerance=TOLERANCE):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.token_id == e.token_id
        assert g.logprob == pytest.approx(e.logprob, abs=tolerance)
        assert list(g.top) == list(e.top), "top-n ids (in order) differ"
        assert list(g.top.values()) == pytest.approx(list(e.top.values()), abs=tolerance)


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("wants", [(None, 0, 3, 5, None), (2, 2, 2, 2, 2), (0, None, None, None, None)])
def test_padded_logprobs_equal_the_host_steps_for_the_same_logits(k, wants):
    n, q, vocab = len(wants), k + 1, 97
    logits = torch.randn(n, q, vocab) * 3
    drafts = [[random.randrange(vocab) for _ in range(k)] for _ in range(n)]
    accepted = [random.randint(0, k) for _ in range(n)]
    accepted[0], accepted[-1] = 0, k  # none and all accepted
    next_token = [random.randrange(vocab) for _ in range(n)]
    want = PaddedLogprobs.for_params([SamplingParams(logprobs=w) for w in wants], CPU)
    out = torch.full((want.size(q) + 7,), -1, dtype=torch.int64)
    packed = padded_step_logprobs(want, logits, torch.tensor(drafts, dtype=torch.int64).view(n, k),
                                  torch.tensor(accepted), torch.tensor(next_token), out)
    assert packed.shape == (want.num_wanting, q, 1 + 2 * want.num_top)
    assert out[want.size(q):].tolist() == [-1] * 7  # nothing written past its part
    expected, emitted = _host_logprobs(logits, drafts, accepted, next_token, wants)
    got = read_padded_logprobs(want, q, out[: want.size(q)].tolist(), emitted)
    for g, e, w, tokens in zip(got, expected, wants, emitted):
        assert (g == []) == (w is None) and len(e) == (0 if w is None else len(tokens))
        _assert_same_logprobs(g, e, tolerance=0.0)  # the same ops on the same rows


def test_emitted_row_tokens_and_no_logprobs():
    drafts = torch.tensor([[5, 6, 7], [8, 9, 10]])
    tokens = emitted_row_tokens(drafts, torch.tensor([2, 0]), torch.tensor([1, 2]))
    assert tokens[0, :3].tolist() == [5, 6, 1] and tokens[1, 0].item() == 2
    assert PaddedLogprobs.for_params([SamplingParams(), SamplingParams()], CPU) is None
    want = PaddedLogprobs.for_params([SamplingParams(logprobs=4), SamplingParams()], CPU)
    assert want.num_top == 4 and want.seq_index.tolist() == [0] and want.size(3) == 3 * 9


# ---- the engine --------------------------------------------------------------------------------

def spec_llm(qwen3_checkpoint, drafter: str, mode="off", **spec) -> LLM:
    """An engine verifying k = 3 drafts of an EAGLE3 head (drafter: its folder; the tiny random
    head's drafts are rejected) or, drafter == qwen3_checkpoint, of the target itself as a draft
    LM (every greedy draft accepted)."""
    method = "draft_model" if drafter == qwen3_checkpoint else "eagle3"
    return fp32_engine(qwen3_checkpoint, async_scheduling=mode,
                       speculative_config={"method": method, "model": drafter, "num_speculative_tokens": 3, **spec})


def greedy(n: int, logprobs: int | None, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs, **extra)


def _assert_outputs_match(got, expected):
    for g, e in zip(got, expected):
        assert g.token_ids == e.token_ids
        if e.logprobs is None:
            assert g.logprobs is None
            continue
        _assert_same_logprobs(g.logprobs, e.logprobs)
        assert g.cumulative_logprob == pytest.approx(e.cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("drafter, mode", [("eagle3", "off"), ("eagle3", "on"), ("draft_model", "on")])
def test_greedy_logprobs_take_the_padded_step_and_equal_plain_decoding(qwen3_checkpoint, eagle3_head, monkeypatch,
                                                                       drafter, mode):
    """A batch mixing requests with and without logprobs, with different top-n, and (async
    scheduling off) one request without speculation (its drafts padded: a step the pipeline
    never queues ahead): every verify takes the padded step (queued ahead with async scheduling
    on), and tokens and logprobs equal plain decoding's host step, the accepted drafts' included
    (the target as its own draft LM accepts them all)."""
    params = [greedy(24, 3), greedy(24, None), greedy(24, 0, use_speculation=mode == "on"), greedy(24, 5)]
    steps = record_host_steps(monkeypatch)
    llm = spec_llm(qwen3_checkpoint, eagle3_head if drafter == "eagle3" else qwen3_checkpoint, mode)
    got = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert all(steps), "a verify batch with logprobs took the host step"
    kind = padded_kind(llm)
    # Near max_tokens a greedy request's acceptance is capped (its rows kept), not its drafts cut:
    # only the request without speculation makes a step mixed.
    assert kind.num_logprob_steps == kind.num_steps > 0 and (kind.num_mixed_steps > 0) == (mode == "off")
    if mode == "on":
        assert llm.engine.runner.pipeline.num_used > 0
    if drafter == "draft_model":
        assert llm.get_stats()["num_accepted_tokens"] > 20
    plain = fp32_engine(qwen3_checkpoint)
    expected = [o.outputs[0] for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    _assert_outputs_match(got, expected)
    assert [len(o.logprobs) for o in got if o.logprobs is not None] == [24, 24, 24]
    assert [len(lp.top) for lp in got[3].logprobs] == [5] * 24 and all(lp.top == {} for lp in got[2].logprobs)


def test_capped_acceptance_near_max_tokens_keeps_its_logprobs(qwen3_checkpoint, monkeypatch):
    """A greedy request with logprobs near max_tokens keeps its draft rows with acceptance capped
    (the scheduler's accept_limit; the target drafting for itself accepts every draft, so the cap
    bites): its logprobs follow the capped emitted rows and equal plain decoding's."""
    caps = []
    verify = GraphedVerify._verify_on_device
    monkeypatch.setattr(GraphedVerify, "_verify_on_device",
                        lambda self, key, n, c, *args: caps.append(c) or verify(self, key, n, c, *args))
    llm = spec_llm(qwen3_checkpoint, qwen3_checkpoint)
    params = greedy(23, 2)
    got = [o.outputs[0] for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
    assert [c for c in caps if c is not None] == [[1, 1]]  # 1 + 4 * 5 tokens, then 2 more: one draft
    assert [len(o.logprobs) for o in got] == [23, 23]
    plain = fp32_engine(qwen3_checkpoint)
    _assert_outputs_match(got, [o.outputs[0] for o in plain.generate(PROMPTS[:2], params, use_tqdm=False)])


def test_k_zero_steps_give_plain_decodings_logprobs(qwen3_checkpoint, monkeypatch):
    """Adaptive speculation (a draft LM that is the target) choosing k = 0 and k = 2 in turn: the
    k = 0 steps (a padded decode) and the verifies carry logprobs, equal to plain decoding's."""
    llm = spec_llm(qwen3_checkpoint, qwen3_checkpoint, adaptive=True)
    force_adaptive_choices(monkeypatch, llm, [0, 2, 0, 0, 2])
    steps = record_host_steps(monkeypatch)
    lengths = record_verify_lengths(monkeypatch, padded_kind(llm))
    params = [greedy(12, 2), greedy(12, None)]
    got = [o.outputs[0] for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
    assert all(steps) and {1, 3} <= set(lengths)
    plain = fp32_engine(qwen3_checkpoint)
    _assert_outputs_match(got, [o.outputs[0] for o in plain.generate(PROMPTS[:2], params, use_tqdm=False)])


def test_seeded_sampled_logprobs_are_the_targets_and_leave_tokens_unchanged(qwen3_checkpoint, eagle3_head,
                                                                           monkeypatch):
    """Seeded sampled requests (one greedy, one without logprobs) on the padded step: each emitted
    token's logprob and top-n equal the target's own scoring of the generated text (a prefill of
    prompt + output with prompt_logprobs: raw log-softmax, the same semantics), and the tokens are
    those of the same requests without logprobs (both take the padded step now)."""
    def sampled(seed, logprobs):
        return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=16, ignore_eos=True,
                              logprobs=logprobs)

    params = [sampled(1, 4), sampled(2, None), greedy(16, 1), sampled(3, 0)]
    steps = record_host_steps(monkeypatch)
    llm = spec_llm(qwen3_checkpoint, eagle3_head)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    kind = padded_kind(llm)
    assert all(steps) and kind.num_logprob_steps > 0 and kind.num_sampled_steps > 0
    without = llm.generate(PROMPTS, [sampled(1, None), sampled(2, None), greedy(16, None), sampled(3, None)],
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in without]
    plain = fp32_engine(qwen3_checkpoint)
    for out, p in zip(outs, params):
        c = out.outputs[0]
        if p.logprobs is None:
            assert c.logprobs is None
            continue
        scored = plain.generate([{"prompt_token_ids": out.prompt_token_ids + c.token_ids}],
                                SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=p.logprobs),
                                use_tqdm=False)[0].prompt_logprobs
        reference = scored[len(out.prompt_token_ids):]  # the entries of the generated tokens
        _assert_same_logprobs(c.logprobs, reference)


def test_verify_length_takes_logprobs_requests(qwen3_checkpoint, eagle3_head):
    """The step plan: a verify batch asking for logprobs gets the padded step's q (it got None,
    the host step, before), a grammar too with a model drafter (structured/padded_verify.py)."""
    kind = padded_kind(spec_llm(qwen3_checkpoint, eagle3_head))

    def item(seq_id, params):
        seq = Sequence(seq_id, f"r{seq_id}", 0, list(range(1, 9)), params, frozenset())
        seq.num_computed_tokens = 8
        return ScheduledSequence(seq, 4, [1, 2, 3], True)

    batch = SchedulerOutput(scheduled=[item(0, greedy(8, 2)), item(1, SamplingParams(temperature=0.7, logprobs=0)),
                                       item(2, greedy(8, None))])
    assert kind.verify_length(batch) == 4
    batch.scheduled.append(item(3, greedy(8, 1, structured_outputs={"regex": "a+"})))
    assert kind.verify_length(batch) == 4


def test_bad_top_n_still_fails_clearly():
    for bad in (21, -1, 2.5):
        with pytest.raises(ValueError, match=r"SamplingParams.logprobs must be an integer between 0 and 20"):
            SamplingParams(logprobs=bad)
    from pydantic import ValidationError

    from foretell.server.protocol import MAX_LOGPROBS, ChatCompletionRequest, CompletionRequest

    with pytest.raises(ValidationError, match="logprobs"):
        CompletionRequest(model="m", prompt="x", logprobs=MAX_LOGPROBS + 1)
    with pytest.raises(ValidationError, match="top_logprobs"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], logprobs=True,
                              top_logprobs=MAX_LOGPROBS + 1)
