"""Stops inside a run of accepted drafts: a verify step may accept several tokens at once, and
whatever ends the output (a stop string, a stop token id, EOS, max_tokens) must cut it exactly where
one-token-a-step decoding would have: the same token ids, text, logprobs and finish reason.

Runs every drafter on the shipped default family (the issue's case: prompt "import os\\nimport",
stop "\\n", where EAGLE3 used to return two tokens past the newline)."""

from __future__ import annotations

import os

import pytest

from foretell import LLM, SamplingParams
from foretell.defaults import member_path

pytestmark = pytest.mark.skipif(not os.path.isdir(member_path("target")), reason="no default models")

PROMPTS = ["import os\nimport", "def add(a, b):\n    return a + b\n\n\ndef", "Question: 2 + 3 =?\nAnswer:"]
DRAFTERS = {
    "none": None,
    "eagle3": {"method": "eagle3", "model": member_path("eagle3"), "num_speculative_tokens": 3},
    "draft_model": {"method": "draft_model", "model": member_path("draft_model"), "num_speculative_tokens": 3},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
}
_ENGINES: dict[str, LLM] = {}


def engine(method: str, family: str = "qwen3") -> LLM:
    key = f"{family}/{method}"
    if key not in _ENGINES:
        spec = DRAFTERS[method] if family == "qwen3" else (
            None if method == "none" else {"method": "mtp", "num_speculative_tokens": 3}
        )
        _ENGINES[key] = LLM(member_path("target", family), num_kv_blocks=64, speculative_config=spec)
    return _ENGINES[key]


def run(llm: LLM, params: SamplingParams, prompts=PROMPTS):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def summary(outs):
    return [
        (o.token_ids, o.text, o.finish_reason, o.stop_reason, [lp.token_id for lp in o.logprobs or []])
        for o in outs
    ]


@pytest.mark.parametrize("method", ["eagle3", "draft_model", "ngram"])
def test_greedy_stop_string_cuts_exactly_as_plain_decoding(method):
    params = SamplingParams(temperature=0, max_tokens=48, stop=["\n"], logprobs=1)
    plain = run(engine("none"), params)
    spec = run(engine(method), params)
    assert summary(spec) == summary(plain)
    for out in plain:
        assert out.finish_reason == "stop" and out.stop_reason == "\n"
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
    stats = engine(method).get_stats()
    assert stats["num_drafts"] > 0


def test_the_issue_case_eagle3():
    tokenizer = engine("none").tokenizer
    params = SamplingParams(temperature=0, max_tokens=32, stop=["\n"])
    plain = run(engine("none"), params, PROMPTS[:1])[0]
    spec = run(engine("eagle3"), params, PROMPTS[:1])[0]
    assert spec.token_ids == plain.token_ids
    # The last token is the one that completed the stop string; nothing follows it.
    assert "\n" in tokenizer.decode(spec.token_ids) and "\n" not in tokenizer.decode(spec.token_ids[:-1])


@pytest.mark.parametrize("method", ["eagle3", "draft_model", "ngram"])
def test_stop_token_ids_eos_and_max_tokens_inside_accepted_drafts(method):
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = run(engine("none"), base)
    for out in plain:
        assert len(out.token_ids) == 40
    # A stop id: the plain output's 6th token; both stop at its first occurrence.
    stop_ids = [out.token_ids[5] for out in plain]
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_ids[i]])
        want = run(engine("none"), params, [prompt])[0]
        got = run(engine(method), params, [prompt])[0]
        assert got.token_ids == want.token_ids == plain[i].token_ids[: plain[i].token_ids.index(stop_ids[i]) + 1]
        assert got.finish_reason == "stop" and got.stop_reason == stop_ids[i]
    # Every max_tokens from 1 to 12: the output is the plain output's prefix.
    for max_tokens in range(1, 13):
        outs = run(engine(method), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        assert [o.token_ids for o in outs] == [p.token_ids[:max_tokens] for p in plain]
        assert all(o.finish_reason == "length" for o in outs)
    # EOS: make the plain output's 8th token an EOS of this engine (and of plain's, for the check).
    for llm in (engine("none"), engine(method)):
        llm.engine.eos_token_ids = frozenset({plain[0].token_ids[7]})
    try:
        params = SamplingParams(temperature=0, max_tokens=40)
        want = run(engine("none"), params, PROMPTS[:1])[0]
        got = run(engine(method), params, PROMPTS[:1])[0]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
        assert len(got.token_ids) <= 8
    finally:
        for llm in (engine("none"), engine(method)):
            llm.engine.eos_token_ids = llm.tokenizer.eos_token_ids


@pytest.mark.parametrize("method", ["eagle3", "draft_model", "ngram"])
def test_sampled_output_ends_at_the_token_that_completes_the_stop(method):
    tokenizer = engine("none").tokenizer
    for seed in range(4):
        params = SamplingParams(temperature=0.8, seed=seed, max_tokens=48, stop=["\n", " the"], logprobs=1)
        for out in run(engine(method), params):
            assert len(out.logprobs) == len(out.token_ids)
            full = tokenizer.decode(out.token_ids)
            assert full.startswith(out.text)
            if out.finish_reason == "stop":
                assert out.stop_reason in ("\n", " the")
                assert full[len(out.text):].startswith(out.stop_reason)
                before = tokenizer.decode(out.token_ids[:-1])
                assert "\n" not in before and " the" not in before
            else:
                assert len(out.token_ids) == 48 and "\n" not in full and " the" not in full


@pytest.mark.skipif(not os.path.isdir(member_path("target", "deepseek")), reason="no DeepSeek default model")
def test_mtp_stop_string_and_max_tokens():
    params = SamplingParams(temperature=0, max_tokens=32, stop=["\n"], logprobs=1)
    plain = run(engine("none", "deepseek"), params)
    spec = run(engine("mtp", "deepseek"), params)
    assert summary(spec) == summary(plain)
    for max_tokens in (1, 2, 3, 5, 8):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert [o.token_ids for o in run(engine("mtp", "deepseek"), params)] == [
            o.token_ids for o in run(engine("none", "deepseek"), params)
        ]


@pytest.mark.skipif(not os.path.isdir(member_path("target", "deepseek")), reason="no DeepSeek default model")
def test_mtp_sampled_output_ends_at_the_token_that_completes_the_stop():
    tokenizer = engine("none", "deepseek").tokenizer
    for seed in range(3):
        params = SamplingParams(temperature=0.8, seed=seed, max_tokens=32, stop=["\n"], logprobs=1)
        for out in run(engine("mtp", "deepseek"), params):
            assert len(out.logprobs) == len(out.token_ids)
            full = tokenizer.decode(out.token_ids)
            if out.finish_reason == "stop" and out.stop_reason == "\n":
                assert full[len(out.text):].startswith("\n")
                assert "\n" not in tokenizer.decode(out.token_ids[:-1])
            elif out.finish_reason == "stop":  # the model's end-of-sequence token (a seed may draw it)
                assert out.token_ids[-1] == out.stop_reason in tokenizer.eos_token_ids and "\n" not in full
            else:
                assert len(out.token_ids) == 32 and "\n" not in full
