"""Logits controls over the API (issue 27): the official `openai` client sends presence_penalty,
frequency_penalty and logit_bias (and vLLM's repetition_penalty, min_tokens, bad_words,
allowed_token_ids through extra_body) to completions and chat completions, with and without
speculative decoding, and gets 200 with the offline engine's greedy output under the same
controls."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_helpers import MODEL_NAME  # noqa: E402

from foretell import LLM, SamplingParams  # noqa: E402

PROMPT = "The cat reads the book. The cat reads the book. The cat"
CHAT = [{"role": "user", "content": "say the cat reads the book"}]
BIAS = {"7": 4.0, "40": -100.0}
EXTRA = {"ignore_eos": True, "repetition_penalty": 1.3, "min_tokens": 3, "bad_words": ["book"]}


def client_for(srv) -> "openai.OpenAI":
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def offline_params(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=16, presence_penalty=0.8, frequency_penalty=0.5,
                          logit_bias={int(t): b for t, b in BIAS.items()}, **extra)


@pytest.fixture(scope="module")
def offline(qwen3_checkpoint):
    with LLM(qwen3_checkpoint, num_kv_blocks=160, max_model_len=512) as llm:
        plain = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].text
        completion = llm.generate([PROMPT], offline_params(**EXTRA), use_tqdm=False)[0].outputs[0].text
        chat = llm.chat(CHAT, offline_params(ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    return plain, completion, chat


@pytest.mark.parametrize("use_spec", [False, True], ids=["plain", "ngram"])
def test_openai_client_sends_penalties_and_logit_bias(request, use_spec, offline):
    plain, want_completion, want_chat = offline
    assert want_completion != plain  # the controls change this output
    client = client_for(request.getfixturevalue("spec_server" if use_spec else "server"))
    result = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                       presence_penalty=0.8, frequency_penalty=0.5, logit_bias=BIAS,
                                       extra_body=EXTRA)
    assert result.choices[0].text == want_completion and "book" not in result.choices[0].text
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0,
                                          presence_penalty=0.8, frequency_penalty=0.5, logit_bias=BIAS,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == want_chat
    streamed = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0,
                                              presence_penalty=0.8, frequency_penalty=0.5, logit_bias=BIAS,
                                              extra_body={"ignore_eos": True}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want_chat


def test_allowed_token_ids_over_the_api(server, qwen3_checkpoint):
    from foretell.tokenizer import Tokenizer

    tokenizer = Tokenizer(qwen3_checkpoint)
    result = client_for(server).completions.create(
        model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=8, temperature=0, logprobs=1,
        extra_body={"allowed_token_ids": [11, 12, 13], "ignore_eos": True})
    tokens = result.choices[0].logprobs.tokens
    assert len(tokens) == 8
    assert set(tokens) <= {tokenizer.decode([t], skip_special_tokens=False) for t in (11, 12, 13)}
