"""Load and lifecycle: 64 concurrent streams, clients that hang up, overload (503), /health before
the model is loaded, an engine that fails to load or fails mid-step."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time

import pytest
import requests
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_helpers import MODEL_NAME, ENGINE_KWARGS, wait_until_idle  # noqa: E402

from foretell.config import build_engine_config  # noqa: E402
from foretell.engine.engine import Engine  # noqa: E402
from foretell.server.api import build_app  # noqa: E402
from foretell.server.async_engine import AsyncEngine  # noqa: E402
from foretell.server.launcher import BackgroundServer  # noqa: E402


def metric_value(srv, line_prefix: str) -> float:
    for line in requests.get(srv.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric line starts with {line_prefix}")


def test_64_concurrent_streaming_clients(server):
    rng = random.Random(0)
    jobs = [
        {"max_tokens": rng.randint(1, 40), "temperature": rng.choice([0.0, 0.5, 1.0, 1.3]),
         "prompt": rng.choice(["The cat", "def add(x):", "Question: what is 2 plus 9?", "x" * rng.randint(1, 60)])}
        for _ in range(64)
    ]
    generated_before = metric_value(server, "foretell:generation_tokens_total")

    async def one(client, job) -> tuple[int, str | None]:
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=job["prompt"], max_tokens=job["max_tokens"],
            temperature=job["temperature"], stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        finish, tokens = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens, finish

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, job) for job in jobs))

    results = asyncio.run(run_all())
    assert [r[1] for r in results] == ["length"] * 64
    assert [r[0] for r in results] == [job["max_tokens"] for job in jobs]  # nothing lost
    stats = wait_until_idle(server)
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert stats["kv_cache_usage"] == 0.0
    assert metric_value(server, "foretell:kv_cache_usage_perc") == 0.0
    assert metric_value(server, "foretell:num_requests_running") == 0.0
    generated = metric_value(server, "foretell:generation_tokens_total") - generated_before
    assert generated == sum(job["max_tokens"] for job in jobs)


def _aborts(srv) -> float:
    try:
        return metric_value(srv, 'foretell:request_success_total{finished_reason="abort"')
    except AssertionError:
        return 0.0


def test_client_dropping_mid_stream_is_aborted(qwen3_checkpoint, server_factory):
    # A request far longer than the client's reading: with 400 tokens (the shared server's room) the
    # tiny model could finish before a client on a loaded 2-core box read its sixth line.
    server = server_factory(qwen3_checkpoint, max_model_len=4096, num_kv_blocks=300)
    aborts_before = _aborts(server)
    body = {"model": MODEL_NAME, "prompt": "The cat", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=30) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6)) if line]
        assert received and received[0].startswith(b"data: ")
        stats = server.server.async_engine.stats()
        assert stats["num_requests_running"] == 1 and stats["kv_cache_usage"] > 0
    # the connection is closed; the request must be aborted long before 4000 tokens
    stats = wait_until_idle(server, timeout=5)
    assert stats["num_requests_running"] == 0 and stats["kv_cache_usage"] == 0.0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert _aborts(server) == aborts_before + 1


def test_client_dropping_a_non_streaming_request_is_aborted(server):
    aborts_before = _aborts(server)
    payload = json.dumps({"model": MODEL_NAME, "prompt": "The cat", "max_tokens": 400, "ignore_eos": True})
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n{payload}".encode())
        deadline = time.monotonic() + 10
        while server.server.async_engine.stats().get("num_requests_running") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    stats = wait_until_idle(server, timeout=5)
    assert stats["num_requests_running"] == 0 and stats["kv_cache_usage"] == 0.0
    assert _aborts(server) == aborts_before + 1


def test_overload_answers_503_with_retry_after(qwen3_checkpoint, server_factory):
    # One sequence slot, and a first request long enough to hold it for the whole test.
    srv = server_factory(qwen3_checkpoint, max_queued_requests=1, max_num_seqs=1,
                         max_model_len=4096, num_kv_blocks=300)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    long_body = {"model": MODEL_NAME, "prompt": "The cat", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with requests.post(srv.url + "/v1/completions", json=long_body, stream=True, timeout=30) as running:
        lines = running.iter_lines()  # keep a reference: closing this iterator would hang up
        next(line for line in lines if line)  # the long request now holds the only sequence slot
        queued_result: dict = {}
        queued = threading.Thread(target=lambda: queued_result.update(
            r=client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3)))
        queued.start()
        deadline = time.monotonic() + 10
        while srv.server.async_engine.num_queued_requests != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        response = requests.post(srv.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"}, timeout=10)
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "1"
        assert response.json()["error"]["code"] == "overloaded"
    queued.join(timeout=30)  # the first stream was dropped: the queued request runs and finishes
    assert queued_result["r"].choices[0].finish_reason in ("length", "stop")


def _manual_server(model: str, engine_factory) -> tuple[BackgroundServer, AsyncEngine]:
    config = build_engine_config(model, **ENGINE_KWARGS)

    def build():
        torch.set_num_threads(1)
        return engine_factory(config)

    async_engine = AsyncEngine(config, engine_factory=build)
    return BackgroundServer(build_app(async_engine, MODEL_NAME), async_engine).start(), async_engine


def test_health_is_503_until_the_engine_is_loaded(qwen3_checkpoint):
    gate = threading.Event()
    srv, async_engine = _manual_server(qwen3_checkpoint, lambda config: (gate.wait(30), Engine(config))[1])
    try:
        health = requests.get(srv.url + "/health", timeout=5)
        assert health.status_code == 503 and "loading" in health.json()["error"]["message"]
        early = requests.post(srv.url + "/v1/completions", json={"prompt": "hi"}, timeout=5)
        assert early.status_code == 503
        gate.set()
        assert async_engine.wait_ready(30)
        assert requests.get(srv.url + "/health", timeout=5).status_code == 200
        ok = requests.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    finally:
        gate.set()
        srv.stop()


def test_engine_that_fails_to_load_stops_the_server(qwen3_checkpoint):
    def broken(config):
        raise ValueError("checkpoint is broken")

    srv, async_engine = _manual_server(qwen3_checkpoint, broken)
    srv.thread.join(timeout=10)
    assert not srv.thread.is_alive() and srv.server.exit_code == 1
    assert "checkpoint is broken" in async_engine.not_ready_reason()
    srv.stop()


def test_a_failing_step_fails_its_requests_not_the_server(qwen3_checkpoint):
    def flaky(config):
        engine = Engine(config)
        real_step, calls = engine.step, []

        def step():
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected failure")
            return real_step()

        engine.step = step
        return engine

    srv, async_engine = _manual_server(qwen3_checkpoint, flaky)
    try:
        assert async_engine.wait_ready(30)
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 5, "ignore_eos": True}
        failed = requests.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert failed.status_code == 500 and "injected failure" in failed.json()["error"]["message"]
        ok = requests.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
        assert wait_until_idle(srv)["kv_cache_usage"] == 0.0
    finally:
        srv.stop()


def test_a_stalled_consumer_keeps_one_output_per_request():
    """Outputs are cumulative: a stream that is not read holds only the latest of each request."""
    from foretell.engine.outputs import CompletionOutput, RequestOutput
    from foretell.server.async_engine import OutputStream

    async def run():
        stream = OutputStream(["a", "b"])
        for step in range(1000):
            for rid in ("a", "b"):
                done = rid == "b" and step == 999
                stream._put(RequestOutput(rid, None, [1], [CompletionOutput(0, "x" * step, [0] * step,
                                                                            "length" if done else None)],
                                          finished=done))
        outputs = await stream.next_outputs()
        assert [(o.request_id, len(o.outputs[0].token_ids)) for o in outputs] == [("a", 999), ("b", 999)]
        assert not stream.finished and stream.in_engine == {"a"}
        return stream

    asyncio.run(run())



def test_async_scheduling_server_streams_aborts_and_leaks_nothing(qwen3_checkpoint, server_factory):
    """With async scheduling forced on (the CPU default is off), concurrent greedy and sampled
    streams of different lengths, and a client hanging up mid-stream while steps are queued
    ahead: greedy completions equal the offline engine's and every KV block is free after."""
    from foretell import LLM, SamplingParams

    srv = server_factory(qwen3_checkpoint, async_scheduling="on")
    assert srv.server.async_engine.engine.runner.pipeline.queue_ahead
    prompts = ["The cat", "def add(x):", "Question: what is 2 plus 9?", "x y z"]
    offline = LLM(qwen3_checkpoint, dtype="float32", **{k: v for k, v in ENGINE_KWARGS.items() if k != "log_stats_interval_s"})
    expected = [o.outputs[0].text for o in offline.generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)]

    async def one(client, i):
        greedy = i < len(prompts)
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=prompts[i % len(prompts)], max_tokens=24 if greedy else 5 + i,
            temperature=0.0 if greedy else 0.8, stream=True, extra_body={"ignore_eos": True})
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def run_all():
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(12)))

    body = {"model": MODEL_NAME, "prompt": "The dog", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with requests.post(srv.url + "/v1/completions", json=body, stream=True, timeout=30) as response:
        assert [line for line, _ in zip(response.iter_lines(), range(4)) if line]  # then hang up
    results = asyncio.run(run_all())
    assert all(finish == "length" for _, finish in results)
    assert [text for text, _ in results[: len(prompts)]] == expected
    stats = wait_until_idle(srv, timeout=10)
    assert stats["num_requests_running"] == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert srv.server.async_engine.engine.runner.pipeline.num_used > 0  # steps were taken from the queue


def test_a_request_failing_in_the_engine_ends_only_its_own_response(qwen3_checkpoint):
    """The engine fails one request inside a step (its final output has finish_reason "error"
    and RequestOutput.error): that request's stream ends with an error event and its
    non-streaming twin gets a 500 naming the failure, while concurrent requests finish whole."""
    import dataclasses

    def poisoning(config):
        engine = Engine(config)
        real_step = engine.step

        def step():
            outputs = real_step()
            for i, out in enumerate(outputs):
                if out.prompt == "poison" and not out.finished and out.outputs[0].token_ids:
                    engine.abort_request(out.request_id)  # what the engine does: free it
                    outputs[i] = dataclasses.replace(
                        out, finished=True, error="request failed inside an engine step: injected failure",
                        outputs=[dataclasses.replace(c, finish_reason="error") for c in out.outputs])
            return outputs

        engine.step = step
        return engine

    srv, async_engine = _manual_server(qwen3_checkpoint, poisoning)
    try:
        assert async_engine.wait_ready(30)

        async def stream(client, prompt: str) -> tuple[int, str | None]:
            chunks = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=30,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})
            tokens, finish = None, None
            async for chunk in chunks:
                if chunk.choices:
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return tokens, finish

        async def whole(client, prompt: str):
            return await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=30,
                                                   extra_body={"ignore_eos": True})

        async def run_all():
            async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                                          timeout=120) as client:
                return await asyncio.gather(
                    stream(client, "The cat"), stream(client, "poison"), whole(client, "poison"),
                    whole(client, "def add(x):"), stream(client, "x y z"), return_exceptions=True)

        results = asyncio.run(run_all())
        assert results[0] == (30, "length") and results[4] == (30, "length")
        assert results[3].choices[0].finish_reason == "length" and results[3].usage.completion_tokens == 30
        assert isinstance(results[1], openai.APIError) and "injected failure" in str(results[1])
        assert isinstance(results[2], openai.InternalServerError) and "injected failure" in str(results[2])
        assert wait_until_idle(srv)["kv_cache_usage"] == 0.0
        assert requests.get(srv.url + "/health", timeout=5).json() == {"status": "ok"}
        assert metric_value(srv, 'foretell:request_success_total{finished_reason="error"') == 2.0
    finally:
        srv.stop()
