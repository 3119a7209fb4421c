"""Bad input: a table of malformed requests, each answered 4xx with an OpenAI-style error body
that says what is wrong; API keys; a schemathesis fuzz run of the OpenAPI schema with no 5xx.
Afterwards the server still serves and no KV block has leaked."""

from __future__ import annotations

import json
import os
import shutil
import socket

import pytest
import requests

pytest.importorskip("fastapi")

from server_helpers import MODEL_NAME, wait_until_idle  # noqa: E402

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

# (id, path, body: dict or raw string, status, text the message must contain, param)
BAD_REQUESTS = [
    ("malformed-json", C, '{"prompt": "x",', 400, "not valid JSON", None),
    ("body-not-object", C, "[1, 2]", 400, "body", None),
    ("missing-prompt", C, {"model": MODEL_NAME}, 400, "Field required", "prompt"),
    ("prompt-wrong-type", C, {"prompt": 5}, 400, "expected a non-empty string", "prompt"),
    ("prompt-mixed-list", C, {"prompt": [1, "a"]}, 400, "token ids", "prompt"),
    ("prompt-empty-string", C, {"prompt": ""}, 400, "prompt", "prompt"),
    ("prompt-empty-list", C, {"prompt": []}, 400, "prompt", "prompt"),
    ("prompt-empty-in-list", C, {"prompt": ["ok", ""]}, 400, "prompt 1 is an empty string", "prompt"),
    ("prompt-too-long", C, {"prompt": [5] * 600}, 400, "600 tokens, but max_model_len is 512", "prompt"),
    ("token-id-out-of-vocab", C, {"prompt": [1, 100000]}, 400, "100000", "prompt"),
    ("token-id-negative", C, {"prompt": [1, -1]}, 400, "prompt", "prompt"),
    ("max-tokens-negative", C, {"prompt": "x", "max_tokens": -1}, 400, "greater than or equal to 1", "max_tokens"),
    ("max-tokens-zero", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ("max-tokens-string", C, {"prompt": "x", "max_tokens": "ten"}, 400, "valid integer", "max_tokens"),
    ("temperature-negative", C, {"prompt": "x", "temperature": -0.5}, 400, "greater than or equal to 0", "temperature"),
    ("temperature-nan", C, '{"prompt": "x", "temperature": NaN}', 400, "temperature", "temperature"),
    ("top-p-zero", C, {"prompt": "x", "top_p": 0}, 400, "greater than 0", "top_p"),
    ("top-p-above-one", C, {"prompt": "x", "top_p": 1.5}, 400, "less than or equal to 1", "top_p"),
    ("top-k-below-minus-one", C, {"prompt": "x", "top_k": -2}, 400, "top_k", "top_k"),
    ("min-p-above-one", C, {"prompt": "x", "min_p": 2}, 400, "min_p", "min_p"),
    ("n-zero", C, {"prompt": "x", "n": 0}, 400, "n", "n"),
    ("n-too-large", C, {"prompt": "x", "n": 1000}, 400, "less than or equal to 128", "n"),
    ("logprobs-too-many", C, {"prompt": "x", "logprobs": 21}, 400, "logprobs", "logprobs"),
    ("seed-too-large", C, {"prompt": "x", "seed": 2**70}, 400, "seed", "seed"),
    ("stop-empty-string", C, {"prompt": "x", "stop": [""]}, 400, "stop", "stop"),
    ("stop-wrong-type", C, {"prompt": "x", "stop": 3}, 400, "expected a string or a list of strings", "stop"),
    ("echo-with-logprobs-streamed", C, {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, 400, "echo", "echo"),
    ("presence-penalty-above-two", C, {"prompt": "x", "presence_penalty": 2.5}, 400, "less than or equal to 2",
     "presence_penalty"),
    ("frequency-penalty-below-minus-two", CHAT, {"messages": USER, "frequency_penalty": -3}, 400, "greater than",
     "frequency_penalty"),
    ("repetition-penalty-zero", C, {"prompt": "x", "repetition_penalty": 0}, 400, "greater than 0",
     "repetition_penalty"),
    ("logit-bias-key-not-id", C, {"prompt": "x", "logit_bias": {"hello": 1}}, 400, "logit_bias", "logit_bias"),
    ("logit-bias-out-of-range", C, {"prompt": "x", "logit_bias": {"5": 150}}, 400, "less than or equal to 100",
     "logit_bias"),
    ("logit-bias-out-of-vocab", C, {"prompt": "x", "logit_bias": {"100000": 1}}, 400, "outside the vocabulary",
     "logit_bias"),
    ("allowed-token-ids-out-of-vocab", CHAT, {"messages": USER, "allowed_token_ids": [1, 99999]}, 400,
     "outside the vocabulary", "allowed_token_ids"),
    ("allowed-token-ids-empty", C, {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids",
     "allowed_token_ids"),
    ("min-tokens-above-max-tokens", C, {"prompt": "x", "min_tokens": 20, "max_tokens": 5}, 400,
     "at most max_tokens (5)", "min_tokens"),
    ("min-tokens-negative", C, {"prompt": "x", "min_tokens": -1}, 400, "greater than or equal to 0", "min_tokens"),
    ("bad-words-not-list", C, {"prompt": "x", "bad_words": "word"}, 400, "bad_words", "bad_words"),
    ("best-of", C, {"prompt": "x", "best_of": 3}, 400, "best_of", "best_of"),
    ("stream-bad-params", C, {"prompt": "x", "stream": True, "top_p": 2}, 400, "top_p", "top_p"),
    ("unknown-model", C, {"prompt": "x", "model": "gpt-9"}, 404, "does not exist", "model"),
    ("chat-missing-messages", CHAT, {"model": MODEL_NAME}, 400, "Field required", "messages"),
    ("chat-empty-messages", CHAT, {"messages": []}, 400, "at least 1", "messages"),
    ("chat-bad-role", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "role", "messages"),
    ("chat-content-number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "content", "messages"),
    ("chat-image-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages", "messages"),
    ("chat-top-logprobs-alone", CHAT, {"messages": USER, "top_logprobs": 2}, 400, "logprobs", "top_logprobs"),
    ("chat-max-tokens-negative", CHAT, {"messages": USER, "max_completion_tokens": -5}, 400, "greater than",
     "max_completion_tokens"),
    ("chat-unknown-model", CHAT, {"messages": USER, "model": "nope"}, 404, "does not exist", "model"),
    # strict types, as OpenAI: no truthy strings or numbers for booleans, no bools for numbers
    ("stream-string", C, {"prompt": "x", "stream": "yes"}, 400, "valid boolean", "stream"),
    ("echo-zero", C, {"prompt": "x", "echo": 0}, 400, "valid boolean", "echo"),
    ("ignore-eos-string", C, {"prompt": "x", "ignore_eos": "false"}, 400, "valid boolean", "ignore_eos"),
    ("presence-penalty-false", C, {"prompt": "x", "presence_penalty": False}, 400, "valid number",
     "presence_penalty"),
    ("temperature-string", C, {"prompt": "x", "temperature": "0.5"}, 400, "valid number", "temperature"),
    ("n-true", C, {"prompt": "x", "n": True}, 400, "valid integer", "n"),
    ("max-tokens-float", C, {"prompt": "x", "max_tokens": 10.0}, 400, "valid integer", "max_tokens"),
    ("max-tokens-numeric-string", C, {"prompt": "x", "max_tokens": "10"}, 400, "valid integer", "max_tokens"),
    ("seed-float", C, {"prompt": "x", "seed": 1.5}, 400, "valid integer", "seed"),
    ("stop-token-ids-bool", C, {"prompt": "x", "stop_token_ids": [True]}, 400, "valid integer", "stop_token_ids"),
    ("prompt-token-bool", C, {"prompt": [1, True]}, 400, "token ids", "prompt"),
    ("logit-bias-bool", C, {"prompt": "x", "logit_bias": {"1": True}}, 400, "valid number", "logit_bias"),
    ("include-usage-string", C, {"prompt": "x", "stream": True, "stream_options": {"include_usage": "true"}},
     400, "valid boolean", "stream_options"),
    ("user-number", C, {"prompt": "x", "user": 5}, 400, "valid string", "user"),
    ("chat-logprobs-one", CHAT, {"messages": USER, "logprobs": 1}, 400, "valid boolean", "logprobs"),
    ("chat-add-generation-prompt-string", CHAT, {"messages": USER, "add_generation_prompt": "no"}, 400,
     "valid boolean", "add_generation_prompt"),
    ("chat-name-number", CHAT, {"messages": [{"role": "user", "content": "x", "name": 3}]}, 400, "name",
     "messages"),
]


def check_error_body(response: requests.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize("path,body,status,text,param", [row[1:] for row in BAD_REQUESTS],
                         ids=[row[0] for row in BAD_REQUESTS])
def test_malformed_request_gets_a_useful_4xx(server, path, body, status, text, param):
    if isinstance(body, str):
        response = requests.post(server.url + path, data=body, headers={"Content-Type": "application/json"}, timeout=10)
    else:
        response = requests.post(server.url + path, json=body, timeout=10)
    error = check_error_body(response, status)
    assert text in error["message"], error
    assert error["param"] == param, error


def test_wrong_method_path_and_content_type(server):
    check_error_body(requests.get(server.url + C, timeout=5), 405)
    error = check_error_body(requests.post(server.url + "/v1/nothing", json={}, timeout=5), 404)
    assert "/v1/nothing" in error["message"]
    check_error_body(requests.post(server.url + C, data="prompt=x", timeout=5,
                                   headers={"Content-Type": "application/x-www-form-urlencoded"}), 400)


def test_oversized_bodies_get_413(server):
    with socket.create_connection((server.host, server.port), timeout=10) as sock:  # declared size
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000\r\n\r\n{")
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")

    def chunked_body():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(33):
            yield b"x" * 2**20
        yield b'"}'

    response = requests.post(server.url + C, data=chunked_body(), timeout=30,
                             headers={"Content-Type": "application/json"})
    assert check_error_body(response, 413)["code"] == "request_too_large"


def test_server_survives_the_table(server):
    ok = requests.post(server.url + C, json={"prompt": "The cat", "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200
    stats = wait_until_idle(server)
    assert stats["kv_cache_usage"] == 0.0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_chat_without_a_template_is_a_clear_400(qwen3_checkpoint, tmp_path, server_factory):
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(qwen3_checkpoint, name), tokenizer / name)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    srv = server_factory(qwen3_checkpoint, tokenizer=str(tokenizer))
    response = requests.post(srv.url + CHAT, json={"messages": USER}, timeout=10)
    error = check_error_body(response, 400)
    assert "chat template" in error["message"] and error["code"] == "no_chat_template"
    assert requests.post(srv.url + C, json={"prompt": "x", "max_tokens": 2}, timeout=30).status_code == 200


def test_api_key(qwen3_checkpoint, server_factory):
    openai = pytest.importorskip("openai")
    srv = server_factory(qwen3_checkpoint, api_key="sekret")
    body = {"prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        error = check_error_body(requests.post(srv.url + C, json=body, headers=headers, timeout=5), 401)
        assert error["type"] == "authentication_error"
    check_error_body(requests.get(srv.url + "/v1/models", timeout=5), 401)
    assert requests.get(srv.url + "/health", timeout=5).status_code == 200  # probes stay open
    assert requests.get(srv.url + "/metrics", timeout=5).status_code == 200
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
    assert client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()


# ------------------------------------------------------------------------------------ fuzzing

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)


@pytest.fixture(scope="module")
def fuzz_schema(qwen3_checkpoint):
    """A server of its own with a short max_model_len, so that fuzzed requests stay cheap."""
    from server_helpers import start_server

    srv = start_server(qwen3_checkpoint, max_model_len=32, num_kv_blocks=48)
    yield schemathesis.openapi.from_url(srv.url + "/openapi.json")
    assert srv.server.async_engine.is_alive
    stats = wait_until_idle(srv)
    assert stats["kv_cache_usage"] == 0.0, "a fuzzed request leaked KV blocks"
    srv.stop()


schema = schemathesis.pytest.from_fixture("fuzz_schema")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_fuzzed_requests_never_get_a_5xx(case):
    response = case.call(timeout=60)
    case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                             content_type_conformance, response_schema_conformance])
