"""What the playground needs from the server, over HTTP (no browser): token origins on completions
and chat, streamed and not (`return_token_origins`), a request without speculation
(`use_speculation: false`), GET /stats, the page's files, and `--no-ui`.

The reference for origins is the engine run offline through LLM with the same settings (its
CompletionOutput.token_origins, themselves checked against the drafts each step verified in
tests/engine/test_token_origins.py) and the engine's own counters (/stats before and after).
"""

from __future__ import annotations

import json

import pytest
import requests

pytest.importorskip("fastapi")

from server_helpers import MODEL_NAME, counter_deltas, wait_until_idle  # noqa: E402

KINDS = {"accepted", "corrected", "bonus", "target"}
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


def stream_chunks(url: str, body: dict) -> list[dict]:
    response = requests.post(url, json={**body, "stream": True}, stream=True, timeout=60)
    assert response.status_code == 200, response.text
    chunks = []
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[6:]))
    return chunks


def stats(srv) -> dict:
    wait_until_idle(srv)
    return requests.get(srv.url + "/stats", timeout=5).json()


def check_origins(origins: list[dict], k: int) -> None:
    for o in origins:
        assert o["origin"] in KINDS
        assert isinstance(o["token"], str) and isinstance(o["token_id"], int)
        if o["origin"] == "target":
            assert o["num_drafts"] == 0 and o["position"] == 0
        else:
            assert 1 <= o["num_drafts"] <= k and 0 <= o["position"] <= o["num_drafts"]
        if o["origin"] == "corrected":
            assert o["replaced_draft"] is not None and o["replaced_draft"] != o["token_id"]
            assert isinstance(o["replaced_draft_token"], str)
        else:
            assert o["replaced_draft"] is None and o["replaced_draft_token"] is None


def test_completion_origins_streamed_equal_unstreamed_and_agree_with_the_stats(spec_server):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "return_token_origins": True}
    before = stats(spec_server)
    full = requests.post(spec_server.url + "/v1/completions", json=body, timeout=60).json()
    after = stats(spec_server)
    choice = full["choices"][0]
    origins = choice["token_origins"]
    assert len(origins) == full["usage"]["completion_tokens"] == 40
    check_origins(origins, 3)
    assert {"accepted", "target"} <= {o["origin"] for o in origins}
    assert "".join(o["token"] for o in origins) == choice["text"]  # plain text: tokens spell it

    # the engine's counters moved by exactly what the origins show (nothing was cut)
    verifies = {}
    for o in origins:
        if o["num_drafts"]:
            verifies.setdefault(o["step"], [o["num_drafts"], 0])[1] += o["origin"] == "accepted"
    s0, s1 = before["stats"], after["stats"]
    assert s1["num_drafts"] - s0["num_drafts"] == len(verifies)
    assert s1["num_draft_tokens"] - s0["num_draft_tokens"] == sum(d for d, _ in verifies.values())
    assert s1["num_accepted_tokens"] - s0["num_accepted_tokens"] == sum(a for _, a in verifies.values())
    histogram = [sum(a == n for _, a in verifies.values()) for n in range(4)]
    deltas = counter_deltas(s0["accepted_count_histogram"], s1["accepted_count_histogram"])
    assert deltas[: len(histogram)] == histogram and not any(deltas[len(histogram):])

    chunks = stream_chunks(spec_server.url + "/v1/completions", body)
    streamed = [o for c in chunks for ch in c["choices"] for o in ch["token_origins"]]
    assert streamed == origins
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == choice["text"]


def test_origins_equal_the_offline_engines(spec_server, qwen3_checkpoint):
    from foretell import LLM, SamplingParams

    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "return_token_origins": True}
    served = requests.post(spec_server.url + "/v1/completions", json=body, timeout=60).json()
    llm = LLM(qwen3_checkpoint, num_kv_blocks=64, max_model_len=512,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    offline = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, return_token_origins=True),
                           use_tqdm=False)[0].outputs[0]
    got = [(o["token_id"], o["origin"], o["step"], o["position"], o["replaced_draft"])
           for o in served["choices"][0]["token_origins"]]
    assert got == [(o.token_id, o.kind, o.step, o.position, o.replaced_draft) for o in offline.token_origins]


def test_chat_origins_streamed_and_not(spec_server):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 20,
            "temperature": 0, "return_token_origins": True}
    full = requests.post(spec_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    origins = full["choices"][0]["token_origins"]
    assert len(origins) == full["usage"]["completion_tokens"]
    check_origins(origins, 3)
    chunks = stream_chunks(spec_server.url + "/v1/chat/completions", body)
    assert [o for c in chunks for ch in c["choices"] for o in ch.get("token_origins", [])] == origins


def test_stop_string_cuts_the_origins_with_the_tokens(spec_server):
    plain = requests.post(spec_server.url + "/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 30, "temperature": 0, "ignore_eos": True,
        "return_token_origins": True}, timeout=60).json()["choices"][0]
    tokens = [o["token"] for o in plain["token_origins"]]
    # a stop string ending inside the output: the text's last token that starts a new word
    stop_at = next(i for i in range(len(tokens) - 1, 4, -1) if tokens[i].strip())
    stop = tokens[stop_at].strip()
    body = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stop": [stop],
            "return_token_origins": True}
    for chunks in (None, stream_chunks(spec_server.url + "/v1/completions", body)):
        if chunks is None:
            result = requests.post(spec_server.url + "/v1/completions", json=body, timeout=60).json()
            origins, usage = result["choices"][0]["token_origins"], result["usage"]
            assert result["choices"][0]["finish_reason"] == "stop"
        else:
            origins = [o for c in chunks for ch in c["choices"] for o in ch["token_origins"]]
            usage = None
        assert [o["token_id"] for o in origins] == [o["token_id"] for o in plain["token_origins"][: len(origins)]]
        assert stop in "".join(o["token"] for o in origins)
        assert stop not in "".join(o["token"] for o in origins[:-1])
        if usage is not None:
            assert len(origins) == usage["completion_tokens"]


def test_plain_clients_see_nothing_new(spec_server):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 6}
    full = requests.post(spec_server.url + "/v1/completions", json=body, timeout=60).json()
    assert "token_origins" not in full["choices"][0]
    for chunk in stream_chunks(spec_server.url + "/v1/completions", body):
        assert all("token_origins" not in ch for ch in chunk["choices"])
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert "token_origins" not in requests.post(spec_server.url + "/v1/chat/completions", json=chat,
                                                timeout=60).json()["choices"][0]


def test_without_speculation_the_same_tokens_and_no_drafts(spec_server):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_origins": True}
    with_spec = requests.post(spec_server.url + "/v1/completions", json=body, timeout=60).json()
    before = stats(spec_server)
    chunks = stream_chunks(spec_server.url + "/v1/completions", {**body, "use_speculation": False})
    after = stats(spec_server)
    origins = [o for c in chunks for ch in c["choices"] for o in ch["token_origins"]]
    assert [o["token_id"] for o in origins] == [o["token_id"] for o in with_spec["choices"][0]["token_origins"]]
    assert {o["origin"] for o in origins} == {"target"}
    assert [o["step"] for o in origins] == list(range(24))
    assert after["stats"]["num_drafts"] == before["stats"]["num_drafts"]


@pytest.mark.parametrize("field, value", [("return_token_origins", "yes"), ("use_speculation", 0)])
def test_the_flags_must_be_booleans(spec_server, field, value):
    response = requests.post(spec_server.url + "/v1/completions",
                             json={"prompt": "hi", "max_tokens": 2, field: value}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field


def test_stats_and_the_page_files(spec_server):
    info = requests.get(spec_server.url + "/stats", timeout=5).json()
    assert info["model"] == MODEL_NAME and info["ready"] is True
    assert info["speculative"] == {"method": "ngram", "model": None, "num_speculative_tokens": 3}
    for key in ("num_requests_running", "num_requests_waiting", "kv_cache_usage", "accepted_per_position",
                "accepted_count_histogram", "mean_acceptance_length", "generation_tokens_total"):
        assert key in info["stats"]
    page = requests.get(spec_server.url + "/", timeout=5)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/ui/app.js"' in page.text
    for name, media_type in [("app.js", "javascript"), ("style.css", "text/css")]:
        asset = requests.get(f"{spec_server.url}/ui/{name}", timeout=5)
        assert asset.status_code == 200 and media_type in asset.headers["content-type"]
    # nothing the page loads comes from elsewhere (the machine may be offline)
    for text in (page.text, requests.get(spec_server.url + "/ui/app.js", timeout=5).text,
                 requests.get(spec_server.url + "/ui/style.css", timeout=5).text):
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text
    assert requests.get(spec_server.url + "/ui/nope.js", timeout=5).status_code == 404


def test_no_ui_serves_no_page_but_keeps_stats(qwen3_checkpoint, server_factory):
    srv = server_factory(qwen3_checkpoint, ui=False)
    assert requests.get(srv.url + "/", timeout=5).status_code == 404
    assert requests.get(srv.url + "/ui/app.js", timeout=5).status_code == 404
    info = requests.get(srv.url + "/stats", timeout=5).json()
    assert info["speculative"] is None and "num_drafts" not in info["stats"]


def test_serve_parser_no_ui_flag():
    from foretell.cli import build_parser

    assert build_parser().parse_args(["serve", "--model", "m"]).ui is True
    assert build_parser().parse_args(["serve", "--model", "m", "--no-ui"]).ui is False
