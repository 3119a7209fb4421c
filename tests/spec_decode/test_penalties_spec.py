"""The logits controls under speculation (issue 27): greedy output with every drafter (eagle3,
draft_model, ngram on the Qwen3 fixture; MTP on the DeepSeek-V3 fixture) equals plain greedy output
token for token with penalties, logit_bias, bad words, min_tokens and allowed_token_ids on (fp32);
min_tokens delays EOS and stop ids (and stop strings); sampled with penalties, the distribution of
the first tokens with speculation matches the one without (chi-square)."""

from __future__ import annotations

import collections

import pytest

from fixtures import deepseek as ds
from fixtures.chi_square import chi2_999, chi_square_two_samples
from foretell import LLM, SamplingParams

PROMPTS = [
    "The cat reads the book. The cat reads the book. The cat",
    "def add(x):\n    return x + 1\ndef add(x):\n    return",
    "a b a b a b a b",
]
DS_PROMPTS = [[5, 17, 250, 3, 99, 41, 7, 5, 17, 250, 3], [300, 12, 8, 8, 61, 2, 19, 300, 12, 8], [9, 9, 9, 9]]
MAX_TOKENS = 14


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def control_sets(baseline: list[list[int]], with_words: bool) -> list[SamplingParams]:
    """Per baseline output (plain greedy without controls), three sets of controls built to
    change it: penalties with biases; bad words and min_tokens against its own tokens; an
    allow list around its tokens with a repetition penalty."""
    sets = []
    for out in baseline:
        sets.append(greedy(presence_penalty=0.7, frequency_penalty=0.9, repetition_penalty=1.4,
                           logit_bias={out[2]: -100.0, out[4]: 3.0, 7: 2.5},
                           bad_words=["the", " book"] if with_words else None))
        sets.append(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=6,
                                   stop_token_ids=[out[1], out[3]],
                                   bad_words_token_ids=[[out[0], out[1]], [out[5]], [out[2], out[3], out[4]]]))
        allowed = sorted(set(out) | {3, 11, 40, 97})
        allowed.remove(out[0])
        sets.append(greedy(allowed_token_ids=allowed, repetition_penalty=1.6, frequency_penalty=-0.3))
    return sets


def run(llm: LLM, prompts, params) -> list[list[int]]:
    repeated = [p for p in prompts for _ in range(3)]
    return [o.outputs[0].token_ids for o in llm.generate(repeated, params, use_tqdm=False)]


def spec_config(method: str, request) -> dict:
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        config["model"] = request.getfixturevalue("qwen3_tied_checkpoint")
    elif method == "eagle3":
        config["model"] = request.getfixturevalue("eagle3_head")
    elif method == "draft_model_self":  # the target drafting for itself: most drafts accepted
        config.update(method="draft_model", model=request.getfixturevalue("qwen3_checkpoint"))
    elif method == "ngram":
        config["prompt_lookup_min"] = 1
    return config


@pytest.fixture(scope="module")
def qwen3_plain(qwen3_checkpoint):
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128) as llm:
        baseline = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
        params = control_sets(baseline, with_words=True)
        yield baseline, params, run(llm, PROMPTS, params)


@pytest.fixture(scope="module")
def deepseek_plain(checkpoint_root, tokenizer_dir):
    folder = ds.checkpoint(checkpoint_root, tokenizer_dir, "v3")
    prompts = [{"prompt_token_ids": p} for p in DS_PROMPTS]
    with LLM(folder, dtype="float32", num_kv_blocks=64) as llm:
        baseline = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
        params = control_sets(baseline, with_words=False)
        yield folder, prompts, baseline, params, run(llm, prompts, params)


def check_controls_bite(baseline, params, outputs):
    """The controls changed the output, and what they promise holds in it."""
    changed = sum(out != baseline[i // 3][: len(out)] for i, out in enumerate(outputs))
    assert changed >= len(outputs) - 2
    for p, out in zip(params, outputs):
        if p.allowed_token_ids is not None:
            assert set(out) <= set(p.allowed_token_ids)
        if p.min_tokens:
            assert len(out) >= p.min_tokens and not set(out[: p.min_tokens - 1]) & set(p.stop_token_ids)
        for word in p.bad_words_token_ids or []:
            assert all(out[i:i + len(word)] != word for i in range(len(out)))
        for token, bias in (p.logit_bias or {}).items():
            assert bias > -100 or token not in out


@pytest.mark.parametrize("method", ["eagle3", "draft_model", "ngram", "draft_model_self"])
def test_greedy_speculation_with_controls_equals_plain(qwen3_checkpoint, qwen3_plain, method, request):
    baseline, params, want = qwen3_plain
    check_controls_bite(baseline, params, want)
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128,
             speculative_config=spec_config(method, request)) as llm:
        assert run(llm, PROMPTS, params) == want
        stats = llm.get_stats()
    assert stats["num_drafts"] > 0
    if method in ("ngram", "draft_model_self"):  # (the random eagle3 head and draft LM accept little)
        assert stats["num_accepted_tokens"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_greedy_mtp_with_controls_equals_plain(deepseek_plain):
    folder, prompts, baseline, params, want = deepseek_plain
    check_controls_bite(baseline, params, want)
    with LLM(folder, dtype="float32", num_kv_blocks=64,
             speculative_config={"method": "mtp", "num_speculative_tokens": 3}) as llm:
        assert run(llm, prompts, params) == want
        stats = llm.get_stats()
    assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] > 0


def test_greedy_ngram_with_controls_under_chunked_prefill_and_preemption(qwen3_checkpoint, qwen3_plain):
    _, params, want = qwen3_plain
    with LLM(qwen3_checkpoint, dtype="float32", max_num_batched_tokens=8, num_kv_blocks=14, block_size=4,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}) as llm:
        assert run(llm, PROMPTS, params) == want
        assert llm.get_stats()["num_preemptions"] > 0


def test_min_tokens_delays_eos_stop_ids_and_stop_strings(qwen3_checkpoint, qwen3_plain):
    baseline = qwen3_plain[0][0]  # plain greedy output of PROMPTS[0]
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}) as llm:
        tokenizer = llm.tokenizer
        # A stop id: its first occurrence ends the output, unless min_tokens says not yet.
        stop = baseline[1]
        short = llm.generate([PROMPTS[0]], greedy(stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
        assert short.token_ids == baseline[:2] and short.finish_reason == "stop"
        delayed = llm.generate([PROMPTS[0]], greedy(stop_token_ids=[stop], min_tokens=5),
                               use_tqdm=False)[0].outputs[0]
        assert len(delayed.token_ids) >= 5 and stop not in delayed.token_ids[:4]
        assert delayed.token_ids[-1] == stop or len(delayed.token_ids) == MAX_TOKENS
        # EOS the same way (the engine's EOS set swapped for the plain output's 2nd token).
        llm.engine.eos_token_ids = frozenset({stop})
        try:
            eos_params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
            assert len(llm.generate([PROMPTS[0]], eos_params, use_tqdm=False)[0].outputs[0].token_ids) == 2
            eos_params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=7)
            out = llm.generate([PROMPTS[0]], eos_params, use_tqdm=False)[0].outputs[0]
            assert len(out.token_ids) >= 7 and stop not in out.token_ids[:6]
        finally:
            llm.engine.eos_token_ids = tokenizer.eos_token_ids
        # A stop string the first token completes stops nothing before min_tokens.
        first_text = tokenizer.decode(baseline[:1])
        text_stop = first_text.strip() or first_text
        out = llm.generate([PROMPTS[0]], greedy(stop=[text_stop], min_tokens=4), use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) >= 4


# ---------------------------------------------------------------------------------- sampled


NUM_SAMPLES = 400
ALLOWED = [60, 61, 62]
# Made of the allowed tokens, so the n-gram drafter proposes them (and many are accepted).
SAMPLED_PROMPT = {"prompt_token_ids": [60, 61, 62] * 4 + [60]}


def first_tokens(llm: LLM, params: SamplingParams) -> list[tuple[int, ...]]:
    outs = llm.generate([SAMPLED_PROMPT] * NUM_SAMPLES, params, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids) for o in outs]


def test_sampled_with_penalties_matches_plain_distribution(qwen3_checkpoint):
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, allowed_token_ids=ALLOWED,
                            frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3,
                            logit_bias={60: 1.0, 61: -1.0})
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=256, max_num_seqs=64, seed=1) as llm:
        plain = first_tokens(llm, params)
        unpenalized = first_tokens(llm, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True,
                                                       allowed_token_ids=ALLOWED))
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=256, max_num_seqs=64, seed=2,
             speculative_config=spec) as llm:
        speculative = first_tokens(llm, params)
        stats = llm.get_stats()
    assert stats["num_accepted_tokens"] > 0.1 * stats["num_draft_tokens"] > 0  # ~22% measured
    for position in (1, 2, 3):
        stat, dof = chi_square_two_samples(collections.Counter(t[position] for t in plain),
                                           collections.Counter(t[position] for t in speculative))
        assert stat < chi2_999(dof), (position, stat, dof)
    stat, dof = chi_square_two_samples(collections.Counter(plain), collections.Counter(speculative))
    assert stat < chi2_999(dof), ("whole outputs", stat, dof)
    distinct = [collections.Counter(len(set(t)) for t in sample) for sample in (plain, speculative, unpenalized)]
    stat, dof = chi_square_two_samples(distinct[0], distinct[1])
    assert stat < chi2_999(dof), ("distinct tokens", stat, dof)
    # The test can see a difference: without the penalties repeats are far more common.
    stat, dof = chi_square_two_samples(distinct[0], distinct[2])
    assert stat > chi2_999(dof), ("penalties changed nothing", stat, dof)
