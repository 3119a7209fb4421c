"""The logits controls on the padded device steps (issue 31 step 2b): penalties, logit_bias,
min_tokens, bad words and allowed_token_ids no longer send a batch to the host step.

Checked here, against the host step's own processing (runner/logits_processing.py's
apply_sampling_controls, the independent reference: host lists rebuilt every step):
  - the function level: for the same logits and drafts, PaddedLogitsControls.apply gives the host
    step's processed logits bit for bit (fp32, CPU), each control alone and all mixed, sequences
    without controls in the batch, k = 0/1/3; the sampled rows' processed probabilities equal;
  - the state advanced on the device by a step's emitted tokens (what a step queued ahead uses)
    equals the state rebuilt from the host's lists after appending those tokens, over many steps;
  - the engine (the CPU's eager padded step, the same code as the captured one): batches with
    controls take the padded step (queued ahead or not) and greedy output with speculation equals
    plain decoding with the same controls, k = 0 steps included; plain decoding queued ahead
    (decode_ahead.py) takes controls and logprobs and equals the host step, greedy and seeded
    sampling (the same draws over the same processed probabilities); sampled verifies with
    controls stay on the padded step and keep what the controls promise;
  - grammars still take the host step, and bad input still fails with its clear errors.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from foretell import LLM, SamplingParams
from foretell.engine.scheduler import ScheduledSequence, SchedulerOutput
from foretell.engine.sequence import Sequence
from foretell.layers.sampler import SamplingBatch, processed_probs
from fixtures.padded_step import (
    force_adaptive_choices,
    fp32_engine,
    padded_kind,
    record_host_steps,
    record_verify_lengths,
)
from foretell.runner.logits_processing import apply_sampling_controls
from foretell.runner.padded_logits_controls import PaddedLogitsControls

CPU = torch.device("cpu")
VOCAB = 61
EOS = 2


def make_seq(seq_id: int, params: SamplingParams, prompt: list[int], output: list[int]) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", 0, prompt, params, frozenset({EOS}))
    seq.token_ids.extend(output)
    return seq


def control_params(rng: random.Random, kind: str, greedy: bool = True) -> SamplingParams:
    """A request with one kind of control (or all of them, or none)."""
    base = dict(temperature=0.0 if greedy else 0.8, top_p=1.0 if greedy else 0.9, max_tokens=64)
    tok = lambda: rng.randrange(VOCAB)  # noqa: E731
    controls = {
        "none": {},
        "presence": dict(presence_penalty=rng.choice([0.7, -1.3])),
        "frequency": dict(frequency_penalty=rng.choice([0.9, -0.4])),
        "repetition": dict(repetition_penalty=rng.choice([1.4, 0.7])),
        "bias": dict(logit_bias={tok(): 3.5, tok(): -100.0, tok(): 0.0}),
        "min_tokens": dict(min_tokens=rng.randint(1, 8), stop_token_ids=[tok(), tok()]),
        "bad_words": dict(bad_words_token_ids=[[tok()], [tok(), tok()], [tok(), tok(), tok()]]),
        "allowed": dict(allowed_token_ids=sorted({tok() for _ in range(20)})),
    }
    if kind == "all":
        merged = {}
        for name, value in controls.items():
            merged.update(value)
        return SamplingParams(**base, **merged)
    return SamplingParams(**base, **controls[kind])


def repetitive_tokens(rng: random.Random, n: int) -> list[int]:
    """Tokens from a small alphabet, so that bad words' prefixes and repeats actually occur."""
    alphabet = [rng.randrange(VOCAB) for _ in range(5)]
    return [rng.choice(alphabet) for _ in range(n)]


def host_processed(logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:
    """The host step's processing of logits [n, q, vocab] (its rows in order, 1 + k per sequence)."""
    n, q, vocab = logits.shape
    items = [ScheduledSequence(seq, q, d, True) for seq, d in zip(seqs, drafts)]
    out = apply_sampling_controls(logits.reshape(n * q, vocab).clone(), items, keep_raw=True)
    return out.view(n, q, vocab)


def random_batch(rng: random.Random, kinds: list[str], k: int, greedy: bool = True):
    seqs, drafts = [], []
    for i, kind in enumerate(kinds):
        params = control_params(rng, kind, greedy)
        prompt = repetitive_tokens(rng, rng.randint(1, 6))
        output = repetitive_tokens(rng, rng.randint(0, 9))
        seqs.append(make_seq(i, params, prompt, output))
        drafts.append(repetitive_tokens(rng, k))
    return seqs, drafts


KINDS = ["presence", "frequency", "repetition", "bias", "min_tokens", "bad_words", "allowed", "all"]


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_each_control_equals_the_host_steps_processing(kind, k):
    rng = random.Random(hash((kind, k)) % 1000)
    for trial in range(4):
        seqs, drafts = random_batch(rng, [kind, "none", kind] if trial % 2 else [kind], k)
        logits = torch.randn(len(seqs), k + 1, VOCAB, generator=torch.Generator().manual_seed(trial)) * 4
        raw = logits.clone()
        controls = PaddedLogitsControls.for_sequences(seqs, VOCAB, CPU)
        got = controls.apply(logits, torch.tensor(drafts, dtype=torch.int64).view(len(seqs), k))
        assert torch.equal(logits, raw), "apply changed the raw logits"
        expected = host_processed(logits, seqs, drafts)
        assert torch.equal(got, expected), f"{kind}: padded != host"
        assert torch.equal(got.isinf(), expected.isinf())
        if kind != "none" and trial % 2:
            assert torch.equal(got[1], raw[1]), "a sequence without controls was touched"


@pytest.mark.parametrize("k", [0, 1, 3])
def test_mixed_batches_and_sampled_rows_processed_probabilities(k):
    """Every kind of control in one batch with sampled and greedy rows: the processed logits
    equal, and so do the probabilities the sampler and the verifier draw from (temperature,
    top-p over the processed logits)."""
    rng = random.Random(100 + k)
    kinds = KINDS + ["none", "all", "bias"]
    seqs, drafts = random_batch(rng, kinds, k, greedy=False)
    n, q = len(seqs), k + 1
    logits = torch.randn(n, q, VOCAB) * 3
    got = PaddedLogitsControls.for_sequences(seqs, VOCAB, CPU).apply(
        logits, torch.tensor(drafts, dtype=torch.int64).view(n, k))
    expected = host_processed(logits, seqs, drafts)
    assert torch.equal(got, expected)
    rows = SamplingBatch.build([seq.sampling_params for seq in seqs for _ in range(q)], [None] * (n * q), VOCAB, CPU)
    got_probs = processed_probs(got.view(n * q, VOCAB), rows)  # [n * q, vocab]
    assert torch.equal(got_probs, processed_probs(expected.view(n * q, VOCAB), rows))


def test_a_batch_without_controls_has_no_state_and_a_grammar_is_no_control():
    seq = make_seq(0, SamplingParams(temperature=0.0), [1, 2], [])
    assert PaddedLogitsControls.for_sequences([seq, seq], VOCAB, CPU) is None
    # A grammar's masks are the padded verify's (structured/padded_verify.py), no state here.
    grammar = make_seq(1, SamplingParams(temperature=0.0, structured_outputs={"regex": "a+"}), [1], [])
    assert PaddedLogitsControls.for_sequences([seq, grammar], VOCAB, CPU) is None


@pytest.mark.parametrize("k", [0, 1, 3])
def test_state_advanced_on_the_device_equals_the_host_lists(k):
    """Steps queued ahead never see the host's lists: over 12 steps with random acceptance, the
    state advanced by each step's emitted tokens processes the next logits exactly as the host
    step does after the tokens are appended (min_tokens running out, bad words' prefixes made of
    earlier steps' tokens, counts growing)."""
    rng = random.Random(7 + k)
    seqs, _ = random_batch(rng, ["all", "none", "bad_words", "min_tokens", "all"], k)
    n, q = len(seqs), k + 1
    controls = PaddedLogitsControls.for_sequences(seqs, VOCAB, CPU)
    for step in range(12):
        drafts = [repetitive_tokens(random.Random(step * 10 + i), k) for i in range(n)]
        drafts_t = torch.tensor(drafts, dtype=torch.int64).view(n, k)
        logits = torch.randn(n, q, VOCAB) * 3
        assert torch.equal(controls.apply(logits, drafts_t), host_processed(logits, seqs, drafts)), f"step {step}"
        accepted = [rng.randint(0, k) for _ in range(n)]
        next_token = [rng.choice(drafts[i] or [5]) if rng.random() < 0.5 else rng.randrange(VOCAB) for i in range(n)]
        controls.advance(drafts_t, torch.tensor(accepted), torch.tensor(next_token))
        for seq, d, a, t in zip(seqs, drafts, accepted, next_token):
            seq.token_ids.extend(d[:a] + [t])


# ---- the engine --------------------------------------------------------------------------------

PROMPTS = ["The cat reads the book. The cat reads the book. The cat", "def add(x):\n    return x + 1\ndef add(x):",
           "a b a b a b a b", "Question: what is 3 plus 7? Answer:"]


def greedy_controls(baseline: list[list[int]], max_tokens: int) -> list[SamplingParams]:
    """Controls built to change the baseline outputs (plain greedy without controls)."""
    b = baseline
    return [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, presence_penalty=0.7,
                       frequency_penalty=0.9, repetition_penalty=1.4, logit_bias={b[0][2]: -100.0, 7: 2.5}),
        SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=6, stop_token_ids=[b[1][1], b[1][3]],
                       bad_words_token_ids=[[b[1][0], b[1][1]], [b[1][5]], [b[1][2], b[1][3], b[1][4]]]),
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, repetition_penalty=1.6,
                       frequency_penalty=-0.3, allowed_token_ids=sorted((set(b[2]) | {3, 11, 40, 97}) - {b[2][0]})),
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),  # none
    ]


def tokens_of(llm: LLM, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_with_controls(qwen3_checkpoint):
    """Plain decoding on the host step: the baseline, the controls, and their outputs."""
    with fp32_engine(qwen3_checkpoint) as llm:
        baseline = tokens_of(llm, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
        params = greedy_controls(baseline, 14)
        want = tokens_of(llm, params)
    assert sum(w != b for w, b in zip(want, baseline)) >= 3, "the controls should change the outputs"
    return params, want


@pytest.mark.parametrize("drafter, mode", [("eagle3", "off"), ("eagle3", "on"), ("draft_model", "on")])
def test_greedy_with_controls_takes_the_padded_step_and_equals_plain(qwen3_checkpoint, eagle3_head, monkeypatch,
                                                                     plain_with_controls, drafter, mode):
    params, want = plain_with_controls
    steps = record_host_steps(monkeypatch)
    model = eagle3_head if drafter == "eagle3" else qwen3_checkpoint
    method = "eagle3" if drafter == "eagle3" else "draft_model"
    with fp32_engine(qwen3_checkpoint, async_scheduling=mode,
                     speculative_config={"method": method, "model": model, "num_speculative_tokens": 3}) as llm:
        assert tokens_of(llm, params) == want
        kind = padded_kind(llm)
        assert all(steps), "a verify batch with logits controls took the host step"
        assert kind.num_controlled_steps == kind.num_steps > 0
        if mode == "on":
            assert llm.engine.runner.pipeline.num_used > 0
        if drafter == "draft_model":  # the target drafting for itself: drafts accepted across controls
            assert llm.get_stats()["num_accepted_tokens"] > 10


def test_k_zero_steps_with_controls_equal_plain(qwen3_checkpoint, monkeypatch, plain_with_controls):
    """Adaptive speculation choosing k = 0 and k = 2 in turn (the draft LM is the target)."""
    params, want = plain_with_controls
    with fp32_engine(qwen3_checkpoint,
                     speculative_config={"method": "draft_model", "model": qwen3_checkpoint,
                                         "num_speculative_tokens": 3, "adaptive": True}) as llm:
        force_adaptive_choices(monkeypatch, llm, [0, 2, 0, 0, 2])
        steps = record_host_steps(monkeypatch)
        lengths = record_verify_lengths(monkeypatch, padded_kind(llm))
        assert tokens_of(llm, params) == want
        assert all(steps) and {1, 3} <= set(lengths)


def test_plain_decoding_queued_ahead_takes_controls_and_logprobs(qwen3_checkpoint, monkeypatch, plain_with_controls):
    """Without a drafter, async scheduling on: requests with controls or logprobs are decoded
    ahead (decode_ahead.py) and equal the host step's tokens and logprobs."""
    params, want = plain_with_controls
    params = list(params)
    params[3] = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=3)
    params[1] = dataclasses.replace(params[1], logprobs=0)
    with fp32_engine(qwen3_checkpoint) as plain:
        expected = plain.generate(PROMPTS, params, use_tqdm=False)
    steps = record_host_steps(monkeypatch)
    with fp32_engine(qwen3_checkpoint, async_scheduling="on") as llm:
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.engine.runner.pipeline.num_used > 0
    assert all(steps), "a decode batch with controls or logprobs took the host step"
    for g, e in zip(got, expected):
        g, e = g.outputs[0], e.outputs[0]
        assert g.token_ids == e.token_ids
        if e.logprobs is None:
            assert g.logprobs is None
            continue
        for a, b in zip(g.logprobs, e.logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert list(a.top) == list(b.top)
    assert [o.outputs[0].token_ids for o in got] == want


def sampled_controls() -> list[SamplingParams]:
    def sampled(seed, **extra):
        return SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=12, ignore_eos=True, **extra)

    return [sampled(1, presence_penalty=1.5, frequency_penalty=1.0, logit_bias={7: 5.0, 11: -100.0}),
            sampled(2, min_tokens=8, stop_token_ids=[3, 4, 5], bad_words_token_ids=[[9], [12, 13]]),
            sampled(3, repetition_penalty=1.8, allowed_token_ids=list(range(20, 60)), logprobs=2),
            sampled(4)]


def check_sampled_controls_hold(outputs: list[list[int]]) -> None:
    assert 11 not in outputs[0]
    assert not set(outputs[1][:7]) & {3, 4, 5} and 9 not in outputs[1]
    assert all(outputs[1][i:i + 2] != [12, 13] for i in range(len(outputs[1])))
    assert set(outputs[2]) <= set(range(20, 60))


def test_seeded_sampling_with_controls_decoded_ahead_equals_the_host_step(qwen3_checkpoint, monkeypatch):
    """Plain decoding: seeded sampled requests with controls draw the same noise at the same
    positions on the device step queued ahead as on the host step, over the same processed
    probabilities, so the tokens are the same."""
    params = sampled_controls()
    with fp32_engine(qwen3_checkpoint) as plain:
        want = tokens_of(plain, params)
    steps = record_host_steps(monkeypatch)
    with fp32_engine(qwen3_checkpoint, async_scheduling="on") as llm:
        assert tokens_of(llm, params) == want
        assert llm.engine.runner.pipeline.num_used > 0
    assert all(steps)
    check_sampled_controls_hold(want)


def test_sampled_verifies_with_controls_take_the_padded_step(qwen3_checkpoint, eagle3_head, monkeypatch):
    """Under speculation (the padded step's greedy drafts against the host step's sampled ones
    make different, equally exact, draws: no token-for-token reference) sampled verifies with
    controls stay on the padded step and what the controls promise holds in their outputs."""
    steps = record_host_steps(monkeypatch)
    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3}
    with fp32_engine(qwen3_checkpoint, speculative_config=spec) as llm:
        got = tokens_of(llm, sampled_controls())
        kind = padded_kind(llm)
        assert all(steps) and kind.num_sampled_steps > 0 and kind.num_controlled_steps == kind.num_steps
    check_sampled_controls_hold(got)


def test_verify_length_takes_controls_and_grammars(qwen3_checkpoint, eagle3_head):
    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3}
    with fp32_engine(qwen3_checkpoint, num_kv_blocks=64, speculative_config=spec) as llm:
        kind = padded_kind(llm)

        def item(seq_id, params):
            seq = Sequence(seq_id, f"r{seq_id}", 0, list(range(1, 9)), params, frozenset())
            seq.num_computed_tokens = 8
            return ScheduledSequence(seq, 4, [1, 2, 3], True)

        batch = SchedulerOutput(scheduled=[item(0, SamplingParams(temperature=0.0, presence_penalty=0.5)),
                                           item(1, SamplingParams(temperature=0.7, logit_bias={3: 1.0}, min_tokens=2)),
                                           item(2, SamplingParams(temperature=0.0, bad_words_token_ids=[[4, 5]]))])
        assert kind.verify_length(batch) == 4
        batch.scheduled.append(item(3, SamplingParams(temperature=0.0, structured_outputs={"regex": "a+"})))
        assert kind.verify_length(batch) == 4  # a model drafter's grammar: structured/padded_verify.py
        structured, kind.structured = kind.structured, None  # without grammar masks (a host drafter's)
        assert kind.verify_length(batch) is None
        kind.structured = structured


@pytest.mark.parametrize("kwargs, message", [
    (dict(presence_penalty=3), "presence_penalty must be a number in"),
    (dict(repetition_penalty=0), "repetition_penalty must be a finite number > 0"),
    (dict(logit_bias={1: 200}), "logit_bias must be a dict"),
    (dict(min_tokens=-1), "min_tokens must be an integer >= 0"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
    (dict(bad_words_token_ids=[[]]), "bad_words_token_ids must be a list of non-empty lists"),
])
def test_bad_input_still_fails_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
