"""max_tokens far past the context is a 400 that names the numbers (issue 33, item 7), for
completions and chat, streamed or not; the server keeps serving and leaks no KV block."""

from __future__ import annotations

import pytest
import requests

pytest.importorskip("fastapi")

from server_helpers import wait_until_idle  # noqa: E402

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 10_000_000}),
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 10_000_000, "stream": True}),
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 510}),  # one past 512
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 10_000_000}),
], ids=["completion", "completion-stream", "one-past", "chat"])
def test_max_tokens_past_the_context_is_a_400(server, path, body):
    response = requests.post(server.url + path, json=body, timeout=10)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert f"max_tokens is {body.get('max_tokens') or body.get('max_completion_tokens')}" in message
    assert "past max_model_len 512" in message


def test_max_tokens_up_to_the_context_is_served(server):
    body = {"prompt": [5, 6, 7], "max_tokens": 509, "ignore_eos": True}  # 3 + 509 = 512
    response = requests.post(server.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 509
    stats = wait_until_idle(server)
    assert stats["kv_cache_usage"] == 0.0
