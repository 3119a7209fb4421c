"""Issue 32's TTFT under a burst: the per-request table of `foretell bench serve`
(--per-request-json: send times and TTFT, the first wave told from later arrivals), the engine
stats taken only when asked (not after every step), a burst's prefills in one step, and the
server's thread switch interval flag."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest

pytest.importorskip("fastapi")

from foretell.bench.serve_summary import RequestResult, per_request_rows, wave_ttft  # noqa: E402
from foretell.cli import main  # noqa: E402
from foretell.config import build_engine_config  # noqa: E402
from foretell.engine.engine import Engine  # noqa: E402
from foretell.sampling_params import SamplingParams  # noqa: E402
from foretell.server.cli import DEFAULT_SWITCH_INTERVAL_MS, check_server_args  # noqa: E402
from server_helpers import ENGINE_KWARGS, wait_until_idle  # noqa: E402


def test_per_request_rows_and_waves():
    results = [RequestResult(True, latency_s=0.5, ttft_s=0.2, output_tokens=4, sent_s=0.0),
               RequestResult(True, latency_s=0.4, ttft_s=0.1, output_tokens=4, sent_s=0.001),
               RequestResult(False, error="HTTP 503", sent_s=0.41),
               RequestResult(True, latency_s=0.3, ttft_s=0.05, output_tokens=4, sent_s=0.5)]
    rows = per_request_rows(results)
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert rows[1]["sent_ms"] == pytest.approx(1.0) and rows[0]["ttft_ms"] == pytest.approx(200.0)
    assert rows[2] == {"index": 2, "sent_ms": pytest.approx(410.0), "ok": False, "ttft_ms": None,
                       "latency_ms": None, "prompt_tokens": None, "output_tokens": 0, "error": "HTTP 503"}
    waves = wave_ttft(rows, concurrency=2)
    assert waves["first_wave"] == pytest.approx(150.0)  # (200 + 100) / 2
    assert waves["later"] == pytest.approx(50.0)  # the failed request has no TTFT
    assert wave_ttft(rows, concurrency=8) == {"first_wave": pytest.approx(350.0 / 3), "later": None}


def test_bench_serve_per_request_json(server, qwen3_checkpoint, tmp_path, capsys):
    table, full = tmp_path / "requests.json", tmp_path / "report.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--dataset", "random", "--tokenizer",
               qwen3_checkpoint, "--input-len", "24", "--concurrency", "1,3", "--num-prompts", "6",
               "--max-tokens", "3", "--ignore-eos", "--no-progress",
               "--per-request-json", str(table), "--output-json", str(full)])
    assert rc == 0
    report = json.loads(table.read_text())
    assert [level["concurrency"] for level in report["levels"]] == [1, 3]
    for level in report["levels"]:
        c, rows = level["concurrency"], level["requests"]
        assert [r["index"] for r in rows] == list(range(6))
        assert all(r["ok"] and r["output_tokens"] == 3 and r["prompt_tokens"] == 24 for r in rows)
        # TTFT is the first chunk with text; the random fixture's tokens may all decode to none.
        timed = [r for r in rows if r["ttft_ms"] is not None]
        assert len(timed) >= 3 and all(0 < r["ttft_ms"] <= r["latency_ms"] for r in timed)
        assert all(r["sent_ms"] >= 0 for r in rows)
        ends = sorted(r["sent_ms"] + r["latency_ms"] for r in rows)
        for i, row in enumerate(rows[c:]):  # closed loop: a later request waits for one to end
            assert row["sent_ms"] >= ends[i] - 5.0, (c, rows)
        assert all(r["sent_ms"] < rows[c]["sent_ms"] for r in rows[:c])  # the first wave goes first
        firsts = [r["ttft_ms"] for r in rows[:c] if r["ttft_ms"] is not None]
        if firsts:
            assert level["ttft_by_wave_ms"]["first_wave"] == pytest.approx(sum(firsts) / len(firsts))
    assert json.loads(full.read_text())["levels"][1]["requests"] == report["levels"][1]["requests"]
    out = capsys.readouterr().out
    assert "first wave" in out and "concurrency 3: " in out


class CountingEngine(Engine):
    """Counts get_stats calls and steps."""

    def __init__(self, config):
        super().__init__(config)
        self.num_get_stats = 0
        self.num_step_calls = 0

    def get_stats(self) -> dict:
        self.num_get_stats += 1
        return super().get_stats()

    def step(self):
        self.num_step_calls += 1
        return super().step()


def test_stats_taken_when_asked_not_every_step(server_factory, qwen3_checkpoint):
    config = build_engine_config(qwen3_checkpoint, **ENGINE_KWARGS)
    srv = server_factory(qwen3_checkpoint, engine_factory=lambda: CountingEngine(config))
    async_engine = srv.server.async_engine
    wait_until_idle(srv)
    engine = async_engine.engine
    before_calls, before_steps = engine.num_get_stats, engine.num_step_calls
    body = {"prompt": "the quick brown fox", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    response = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200
    stats = wait_until_idle(srv)
    steps = engine.num_step_calls - before_steps
    assert steps >= 12  # 24 tokens, one per step after the prefill
    # A snapshot when the engine goes idle, and after the steps wait_until_idle asked for; none
    # after the steps nobody asked about.
    assert engine.num_get_stats - before_calls <= 4, (engine.num_get_stats - before_calls, steps)
    assert stats["num_requests_running"] == 0 and stats["generation_tokens_total"] >= 24
    # /metrics and /stats are exact: a snapshot taken for them between steps.
    generated = stats["generation_tokens_total"]
    metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    assert f'foretell:generation_tokens_total{{model_name="tiny-qwen3"}} {float(generated)}' in metrics
    assert httpx.get(srv.url + "/stats", timeout=10).json()["stats"]["generation_tokens_total"] == generated


def test_stats_while_running_are_fresh(server_factory, qwen3_checkpoint):
    """/stats during a stream shows the running request (a snapshot taken between two steps,
    not the idle engine's last one)."""
    srv = server_factory(qwen3_checkpoint)
    wait_until_idle(srv)
    body = {"prompt": "a b c", "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", srv.url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # generating now
            stats = client.get(srv.url + "/stats").json()["stats"]
            assert stats["num_requests_running"] == 1 and stats["generation_tokens_total"] >= 1
            response.close()
    assert wait_until_idle(srv)["num_requests_running"] == 0


def test_burst_prefills_in_one_step(qwen3_checkpoint):
    """16 prompts added together (one command pass of the engine thread) all get their first
    token from the first step: the default token budget admits the whole burst at once."""
    engine = Engine(build_engine_config(qwen3_checkpoint, **ENGINE_KWARGS))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(16):
        engine.add_request(f"r{i}", {"prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(20 + i)]}, params)
    outputs = engine.step()
    assert sorted(out.request_id for out in outputs) == sorted(f"r{i}" for i in range(16))
    assert all(len(out.outputs[0].token_ids) == 1 for out in outputs)


def test_switch_interval_flag():
    args = argparse.Namespace(port=8000, max_request_bytes=1, max_queued_requests=None,
                              switch_interval_ms=DEFAULT_SWITCH_INTERVAL_MS)
    check_server_args(args)
    assert 0 < DEFAULT_SWITCH_INTERVAL_MS < 5
    for bad in (0.0, -1.0, 2000.0):
        args.switch_interval_ms = bad
        with pytest.raises(ValueError, match="--switch-interval-ms"):
            check_server_args(args)
