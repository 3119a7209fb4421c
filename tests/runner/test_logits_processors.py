"""The logits controls (penalties, logit_bias, bad words, min_tokens, allowed_token_ids) on the
device against a float64 plain-Python reference, row by row, with drafts: row j of a verify is
processed as if the drafts before it had been accepted. Plus SamplingParams' checks of bad input
and the engine's checks of token ids against the vocabulary."""

from __future__ import annotations

import math
import random

import pytest
import torch

from foretell import LLM, SamplingParams
from foretell.engine.scheduler import ScheduledSequence
from foretell.engine.sequence import Sequence
from foretell.runner.logits_processing import apply_sampling_controls, build_controls
from foretell.sampling_params import bad_words_token_ids

VOCAB = 40
EOS = 2


def reference_row(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams,
                  eos_ids: set[int]) -> list[float]:
    """One row in float64, written from the definitions: `output` is every token generated before
    this row's (drafts before it included)."""
    out = [float(x) for x in logits]
    for token, bias in (p.logit_bias or {}).items():
        out[token] += bias
    for token in range(len(out)):
        count = output.count(token)
        if p.repetition_penalty != 1.0 and (count or token in prompt):
            out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
        out[token] -= p.frequency_penalty * count + p.presence_penalty * (1.0 if count else 0.0)
    history = prompt + output
    if len(output) < p.min_tokens:
        for token in list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(eos_ids)):
            out[token] = -math.inf
    for word in p.bad_words_token_ids or []:
        prefix = word[:-1]
        if len(history) >= len(prefix) and history[len(history) - len(prefix):] == prefix:
            out[word[-1]] = -math.inf
    if p.allowed_token_ids is not None:
        out = [x if t in p.allowed_token_ids else -math.inf for t, x in enumerate(out)]
    return out


def random_params(rng: random.Random) -> SamplingParams:
    kinds = rng.sample(["presence", "frequency", "repetition", "min_tokens", "bias", "bad", "allowed"], rng.randint(0, 4))
    kw: dict = dict(temperature=rng.choice([0.0, 0.7]), max_tokens=30, ignore_eos=rng.random() < 0.3,
                    stop_token_ids=rng.sample(range(VOCAB), rng.randint(0, 2)))
    if "presence" in kinds:
        kw["presence_penalty"] = rng.uniform(-2, 2)
    if "frequency" in kinds:
        kw["frequency_penalty"] = rng.uniform(-2, 2)
    if "repetition" in kinds:
        kw["repetition_penalty"] = rng.uniform(0.3, 2.5)
    if "min_tokens" in kinds:
        kw["min_tokens"] = rng.randint(1, 12)
    if "bias" in kinds:
        kw["logit_bias"] = {t: rng.uniform(-100, 100) for t in rng.sample(range(VOCAB), rng.randint(1, 5))}
    if "bad" in kinds:
        kw["bad_words_token_ids"] = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))]
                                     for _ in range(rng.randint(1, 4))]
    if "allowed" in kinds:
        kw["allowed_token_ids"] = rng.sample(range(VOCAB), rng.randint(1, 12))
    return SamplingParams(**kw)


def make_item(rng: random.Random, seq_id: int, params: SamplingParams) -> ScheduledSequence:
    small = list(range(8))  # a small alphabet so that tokens repeat and bad-word prefixes match
    prompt = [rng.choice(small) for _ in range(rng.randint(1, 10))]
    seq = Sequence(seq_id, f"r{seq_id}", 0, prompt, params, frozenset({EOS}))
    seq.token_ids += [rng.choice(small) for _ in range(rng.randint(0, 10))]
    drafts = [rng.choice(small) for _ in range(rng.choice([0, 0, 1, 3, 5]))]
    seq.num_computed_tokens = seq.num_tokens - 1
    return ScheduledSequence(seq, 1 + len(drafts), drafts, samples=True)


@pytest.mark.parametrize("seed", range(12))
def test_device_controls_equal_the_float64_reference_with_drafts(seed):
    rng = random.Random(seed)
    items = [make_item(rng, i, random_params(rng)) for i in range(rng.randint(1, 6))]
    num_rows = sum(len(item.draft_token_ids) + 1 for item in items)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, VOCAB, generator=gen) * 3  # [rows, vocab] float32
    want = []
    for item in items:
        seq, p = item.seq, item.seq.sampling_params
        for j in range(len(item.draft_token_ids) + 1):
            row = logits[len(want)].tolist()
            output = seq.output_token_ids + item.draft_token_ids[:j]
            want.append(reference_row(row, seq.prompt_token_ids, output, p, set(seq.eos_token_ids)))
    raw = logits.clone()
    got = apply_sampling_controls(logits, items, keep_raw=True)
    assert torch.equal(logits, raw)  # keep_raw: the caller's logits untouched (logprobs are raw)
    want_t = torch.tensor(want, dtype=torch.float64)
    assert torch.equal(torch.isinf(got), torch.isinf(want_t))
    finite = ~torch.isinf(want_t)
    torch.testing.assert_close(got.double()[finite], want_t[finite], rtol=1e-5, atol=1e-4)
    in_place = apply_sampling_controls(logits, items, keep_raw=False)
    assert in_place.data_ptr() == logits.data_ptr() and torch.equal(in_place, got)


def test_rows_without_controls_are_untouched_and_no_controls_costs_nothing():
    rng = random.Random(0)
    plain = make_item(rng, 0, SamplingParams(temperature=0))
    penalized = make_item(rng, 1, SamplingParams(temperature=0, frequency_penalty=1.5, logit_bias={3: -7.0}))
    rows = len(plain.draft_token_ids) + 1
    logits = torch.randn(rows + len(penalized.draft_token_ids) + 1, VOCAB)
    assert apply_sampling_controls(logits, [plain], keep_raw=False) is logits
    before = logits.clone()
    apply_sampling_controls(logits, [plain, penalized], keep_raw=False)
    assert torch.equal(logits[:rows], before[:rows])
    assert not torch.equal(logits[rows:], before[rows:])
    controls = build_controls([plain, penalized], torch.device("cpu"))
    assert controls.rows.tolist() == list(range(rows, logits.shape[0]))


def test_row_j_counts_the_drafts_before_it():
    """A hand-checked case: frequency 1 and a bad word (5, 6) over drafts 5, 5, 6."""
    params = SamplingParams(temperature=0, frequency_penalty=1.0, bad_words_token_ids=[[5, 6]], min_tokens=3,
                            stop_token_ids=[9])
    seq = Sequence(0, "r", 0, [1, 2], params, frozenset({EOS}))
    seq.token_ids += [7]  # one output token so far
    item = ScheduledSequence(seq, 4, [5, 5, 6], samples=True)
    logits = torch.zeros(4, VOCAB)
    apply_sampling_controls(logits, [item], keep_raw=False)
    assert logits[:, 5].tolist() == [0.0, -1.0, -2.0, -2.0]  # counted from row 1 on
    assert logits[:, 6].tolist() == [0.0, -math.inf, -math.inf, -1.0]  # banned after a 5
    assert logits[:, 7].tolist() == [-1.0] * 4
    # min_tokens 3: rows 0 and 1 complete outputs 2 and 3 (EOS and 9 banned), rows 2 and 3 may stop.
    assert logits[:, EOS].tolist() == [-math.inf, -math.inf, 0.0, 0.0]
    assert logits[:, 9].tolist() == [-math.inf, -math.inf, 0.0, 0.0]


class FakeHF:
    """A tokenizer whose words are characters: ' x' is one token (100 + ord) when x is a letter."""

    def encode(self, text, add_special_tokens=False):
        assert add_special_tokens is False
        if text.startswith(" ") and len(text) > 1 and text[1].isalpha():
            return [100 + ord(text[1])] + [ord(c) for c in text[2:]]
        return [ord(c) for c in text]


def test_bad_words_are_tokenized_plain_and_after_a_space():
    assert bad_words_token_ids(["ab", " cd", "1"], FakeHF().encode) == [
        [97, 98], [197, 98], [99, 100], [199, 100], [49],  # "1" after a space is 2 tokens: not added
    ]


BAD_PARAMS = [
    (dict(presence_penalty=2.5), "presence_penalty", "[-2, 2]"),
    (dict(frequency_penalty=-3), "frequency_penalty", "[-2, 2]"),
    (dict(frequency_penalty=True), "frequency_penalty", "a number"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "> 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty", "finite"),
    (dict(min_tokens=-1), "min_tokens", ">= 0"),
    (dict(min_tokens=1.5), "min_tokens", "integer"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens", "at most max_tokens (10)"),
    (dict(logit_bias={"5": 1.0}), "logit_bias", "integer token ids"),
    (dict(logit_bias={5: 101.0}), "logit_bias", "[-100, 100]"),
    (dict(logit_bias={-1: 1.0}), "logit_bias", "non-negative"),
    (dict(logit_bias=[5]), "logit_bias", "a dict"),
    (dict(bad_words="word"), "bad_words", "a list"),
    (dict(bad_words=[" "]), "bad_words", "non-blank"),
    (dict(bad_words_token_ids=[[]]), "bad_words_token_ids", "non-empty lists"),
    (dict(bad_words_token_ids=[[1, -2]]), "bad_words_token_ids", "non-negative"),
    (dict(allowed_token_ids=[]), "allowed_token_ids", "non-empty"),
    (dict(allowed_token_ids=[1, "2"]), "allowed_token_ids", "token ids"),
]


@pytest.mark.parametrize("kwargs,field,expected", BAD_PARAMS, ids=[b[1] + str(i) for i, b in enumerate(BAD_PARAMS)])
def test_bad_params_get_a_clear_error(kwargs, field, expected):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert f"SamplingParams.{field} must be" in str(info.value) and expected in str(info.value)


def test_needs_logits_processing():
    assert not SamplingParams().needs_logits_processing
    assert not SamplingParams(presence_penalty=0, repetition_penalty=1.0, logit_bias={}).needs_logits_processing
    for kw in (dict(presence_penalty=0.1), dict(frequency_penalty=-0.1), dict(repetition_penalty=1.1),
               dict(min_tokens=1), dict(logit_bias={1: 0.5}), dict(bad_words=["x"]),
               dict(bad_words_token_ids=[[1]]), dict(allowed_token_ids=[3])):
        assert SamplingParams(**kw).needs_logits_processing, kw


def test_the_engine_checks_token_ids_against_the_vocabulary(qwen3_checkpoint):
    with LLM(qwen3_checkpoint, num_kv_blocks=16) as llm:
        vocab = llm.engine.facts.vocab_size
        for kw, field in ((dict(logit_bias={vocab: 1.0}), "logit_bias"),
                          (dict(allowed_token_ids=[1, vocab + 5]), "allowed_token_ids"),
                          (dict(bad_words_token_ids=[[1, vocab]]), "bad_words_token_ids")):
            with pytest.raises(ValueError, match=rf"SamplingParams\.{field} holds token ids outside the vocabulary"):
                llm.generate(["hi"], SamplingParams(max_tokens=2, **kw), use_tqdm=False)
        # bad_words become token sequences; nothing is left running after the refusals
        out = llm.generate(["hi"], SamplingParams(max_tokens=3, temperature=0, bad_words=["the"]), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) >= 1
        assert llm.get_stats()["num_requests_running"] == 0


def test_generate_cli_flags(qwen3_checkpoint, capsys):
    from foretell import cli

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, presence_penalty=0.5,
                            frequency_penalty=1.5, repetition_penalty=1.2, min_tokens=2,
                            logit_bias={7: 3.0}, bad_words=["the"], allowed_token_ids=list(range(5, 300)))
    with LLM(qwen3_checkpoint, num_kv_blocks=32) as llm:
        want = llm.generate("The cat", params, use_tqdm=False)[0].outputs[0].text
    argv = ["generate", qwen3_checkpoint, "--prompt", "The cat", "--max-tokens", "8", "--ignore-eos",
            "--num-kv-blocks", "32", "--stream", "off", "--presence-penalty", "0.5", "--frequency-penalty", "1.5",
            "--repetition-penalty", "1.2", "--min-tokens", "2", "--logit-bias", '{"7": 3}', "--bad-words", "the",
            "--allowed-token-ids", ",".join(str(t) for t in range(5, 300))]
    assert cli.main(argv) == 0
    assert f"The cat{want}\n" in capsys.readouterr().out
    for flag, value, message in (("--logit-bias", "[1]", "--logit-bias must be a JSON object"),
                                 ("--allowed-token-ids", "1,x", "--allowed-token-ids must be comma-separated")):
        with pytest.raises(SystemExit, match=message):
            cli.main(["generate", qwen3_checkpoint, "--prompt", "x", flag, value])
    assert cli.main(["generate", qwen3_checkpoint, "--prompt", "x", "--presence-penalty", "3"]) != 0
    assert "presence_penalty must be a number in [-2, 2]" in capsys.readouterr().err


def test_requests_with_controls_stay_off_the_paths_that_sample_without_them():
    """The TP greedy-without-logits shortcut samples without any controls: a request with some
    takes the host step there. The padded verify and decode-ahead carry the controls' state on
    the device (runner/padded_logits_controls.py) and take them; a grammar (its matcher lives on
    the host) takes the host step everywhere."""
    from types import SimpleNamespace

    from foretell.engine.scheduler import SchedulerOutput
    from foretell.runner.decode_ahead import plain_decode
    from foretell.runner.graphed_verify import GraphedVerify
    from foretell.runner.host_step import HostStep

    def sched_for(params: SamplingParams, drafts: list[int]) -> SchedulerOutput:
        seq = Sequence(0, "r", 0, [1, 2, 3], params)
        seq.num_computed_tokens = 2
        return SchedulerOutput([ScheduledSequence(seq, 1 + len(drafts), drafts, samples=True)])

    batch = SimpleNamespace(sampling_seq_index=[0])
    host = HostStep(None, None, None, VOCAB, 16, 100, torch.device("cpu"), tensor_parallel=True)
    loop = SimpleNamespace(k=2, verify_lens=(3,))
    padded = SimpleNamespace(draft_graphs=loop, graphs=SimpleNamespace(bucket_for=lambda b: (1, 3)), max_model_len=100)
    padded.verify_length = lambda sched: GraphedVerify.verify_length(padded, sched)
    padded.enabled, padded.structured = True, None  # no grammar masks: grammars on the host step
    padded._length_that_fits = lambda sched, b: GraphedVerify._length_that_fits(padded, sched, b)
    for params, plain, padded_ok in ((SamplingParams(temperature=0), True, True),
                                     (SamplingParams(temperature=0, presence_penalty=0.1), False, True),
                                     (SamplingParams(temperature=0, min_tokens=1), False, True),
                                     (SamplingParams(temperature=0, structured_outputs={"regex": "a+"}), False, False)):
        assert plain_decode(sched_for(params, []).scheduled) is padded_ok
        assert host.greedy_without_logits(sched_for(params, []), batch) is plain
        assert GraphedVerify.fits(padded, sched_for(params, [4, 5]), batch) is padded_ok
