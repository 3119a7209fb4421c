"""The server through the official `openai` client: completions, chat, streaming, logprobs, n > 1,
and greedy output equal to the offline LLM's, with and without speculative decoding."""

from __future__ import annotations

import pytest
import requests

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_helpers import MODEL_NAME, start_server, wait_until_idle  # noqa: E402

from foretell import LLM, SamplingParams  # noqa: E402

PROMPTS = ["The cat reads", "def add(x):\n    return", "Question: what is 3 plus 7? Answer:"]


def client_for(srv, api_key: str = "unused") -> "openai.OpenAI":
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline_greedy(qwen3_checkpoint):
    """Offline greedy completions of PROMPTS (token ids and text) and of one chat."""
    llm = LLM(qwen3_checkpoint, num_kv_blocks=160, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    chat = llm.chat([{"role": "user", "content": "hi there"}], params, use_tqdm=False)[0]
    return {
        "completions": [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs],
        "chat": chat.outputs[0].text,
    }


def test_models_health_and_metrics(server):
    models = client_for(server).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    health = requests.get(server.url + "/health", timeout=5)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert health.headers["content-type"] == "application/json"
    client_for(server).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    text = requests.get(server.url + "/metrics", timeout=5).text
    for name in ["foretell:num_requests_running", "foretell:num_requests_waiting",
                 "foretell:kv_cache_usage_perc", "foretell:prompt_tokens_total",
                 "foretell:generation_tokens_total", "foretell:time_to_first_token_seconds_bucket",
                 "foretell:time_per_output_token_seconds_bucket", "foretell:jit_compiles_total"]:
        assert name in text, name


@pytest.mark.parametrize("use_spec", [False, True], ids=["plain", "ngram"])
def test_greedy_completion_equals_offline(request, use_spec, offline_greedy):
    srv = request.getfixturevalue("spec_server" if use_spec else "server")
    client = client_for(srv)
    result = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=24,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert len(result.choices) == len(PROMPTS)
    for choice, (_, text) in zip(sorted(result.choices, key=lambda c: c.index), offline_greedy["completions"]):
        assert choice.text == text
        assert choice.finish_reason == "length"
    assert result.usage.completion_tokens == 24 * len(PROMPTS)
    # token-id prompts give the same text, streaming gives the same text
    ids = srv.server.async_engine.tokenizer.encode(PROMPTS[0])
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == offline_greedy["completions"][0][1]
    chunks = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=24,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == offline_greedy["completions"][1][1]
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=24, temperature=0,
                                          messages=[{"role": "user", "content": "hi there"}],
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == offline_greedy["chat"]
    if use_spec:
        metrics = requests.get(srv.url + "/metrics", timeout=5).text
        for name in ["foretell:spec_decode_num_drafts_total", "foretell:spec_decode_num_draft_tokens_total",
                     "foretell:spec_decode_num_accepted_tokens_total",
                     'foretell:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny-qwen3",position="2"}']:
            assert name in metrics, name


def test_greedy_equals_offline_with_draft_model(qwen3_checkpoint, offline_greedy):
    spec = {"method": "draft_model", "model": qwen3_checkpoint, "num_speculative_tokens": 2}
    srv = start_server(qwen3_checkpoint, speculative_config=spec)
    try:
        result = client_for(srv).completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=24,
                                                    temperature=0, extra_body={"ignore_eos": True})
        texts = [c.text for c in sorted(result.choices, key=lambda c: c.index)]
        assert texts == [text for _, text in offline_greedy["completions"]]
        stats = srv.server.async_engine.stats()
        assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] > 0  # the draft is the target
    finally:
        srv.stop()


def test_streaming_chat_with_usage(server):
    stream = client_for(server).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_logprobs_and_n(server):
    client = client_for(server)
    result = client.completions.create(model=MODEL_NAME, prompt="The cat", max_tokens=5, logprobs=3,
                                       n=3, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    for choice in result.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(3 <= len(top) <= 4 for top in lp.top_logprobs)  # top 3 plus the sampled token
    again = client.completions.create(model=MODEL_NAME, prompt="The cat", max_tokens=5, n=3,
                                      temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in result.choices]  # seeded

    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=4, logprobs=True, top_logprobs=2, n=2,
                                          extra_body={"ignore_eos": True})
    assert len(chat.choices) == 2
    for choice in chat.choices:
        assert len(choice.logprobs.content) == 4
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)

    stream = client.completions.create(model=MODEL_NAME, prompt=["a", "b"], max_tokens=6, n=2,
                                       logprobs=1, stream=True, extra_body={"ignore_eos": True})
    texts: dict[int, str] = {}
    tokens: dict[int, int] = {}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            tokens[c.index] = tokens.get(c.index, 0) + (len(c.logprobs.tokens) if c.logprobs else 0)
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2, 3} and all(n == 6 for n in tokens.values())
    assert wait_until_idle(server)["num_requests_running"] == 0


def test_stop_strings_never_leak_in_stream(server):
    """The stop string is cut from the streamed text exactly as from the final text."""
    client = client_for(server)
    full = client.completions.create(model=MODEL_NAME, prompt="The cat reads", max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[6:9] if len(full) >= 9 else full[-2:]
    expected = client.completions.create(model=MODEL_NAME, prompt="The cat reads", max_tokens=24,
                                         temperature=0, stop=[stop]).choices[0]
    streamed = client.completions.create(model=MODEL_NAME, prompt="The cat reads", max_tokens=24,
                                         temperature=0, stop=[stop], stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert stop not in expected.text and expected.finish_reason == "stop"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_echo(server):
    result = client_for(server).completions.create(model=MODEL_NAME, prompt="The cat", max_tokens=3,
                                                   echo=True, temperature=0)
    assert result.choices[0].text.startswith("The cat")


def test_every_answer_is_what_the_openapi_document_says(server):
    """Status codes and content types of real answers (JSON, streams, errors, probes) are the
    ones documented for their endpoint, JSON bodies match the documented schema, and no 422
    (FastAPI's default, never sent here) is promised."""
    jsonschema = pytest.importorskip("jsonschema")
    doc = requests.get(server.url + "/openapi.json", timeout=5).json()
    components = doc["components"]["schemas"]
    assert "HTTPValidationError" not in components

    def check(method: str, path: str, response: requests.Response) -> None:
        documented = doc["paths"][path][method]["responses"]
        assert "422" not in documented
        assert str(response.status_code) in documented, (path, response.status_code)
        media_type = response.headers["content-type"].split(";")[0]
        content = documented[str(response.status_code)].get("content", {})
        assert media_type in content, (path, response.status_code, media_type)
        if media_type == "application/json":
            schema = {**content[media_type]["schema"], "components": {"schemas": components}}
            jsonschema.validate(response.json(), schema)  # $refs resolve in the merged components

    check("get", "/health", requests.get(server.url + "/health", timeout=5))
    check("get", "/metrics", requests.get(server.url + "/metrics", timeout=5))
    check("get", "/v1/models", requests.get(server.url + "/v1/models", timeout=5))
    for path, body in [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}),
        ("/v1/completions", {"prompt": "hi", "stream": "yes"}),
        ("/v1/completions", {"prompt": "hi", "model": "nope"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                  "logprobs": True, "top_logprobs": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                  "stream": True}),
    ]:
        check("post", path, requests.post(server.url + path, json=body, timeout=30))


def test_jit_compiles_metric_follows_the_triton_hook(server):
    """foretell:jit_compiles_total is the count of the hook Triton calls after each compilation
    (none on the CPU, where the interpreter compiles nothing: one is simulated here)."""
    from foretell.runner.jit_counter import jit_compile_counter

    def metric() -> float:
        for line in requests.get(server.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith("foretell:jit_compiles_total{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("no foretell:jit_compiles_total")

    client_for(server).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
    before = metric()
    assert before == jit_compile_counter().count
    jit_compile_counter()(key="k", repr="r", fn=None, compile={}, is_manual_warmup=False,
                          already_compiled=False)
    client_for(server).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)  # new stats
    assert metric() == before + 1
