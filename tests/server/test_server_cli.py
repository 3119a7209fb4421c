"""`foretell serve` as a user runs it: a subprocess on 127.0.0.1 with FORETELL_API_KEY; SIGTERM
ends open streams (finish_reason "abort"), stops accepting connections, and exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_parser_reads_the_api_key_from_the_environment(monkeypatch):
    from foretell.cli import build_parser

    monkeypatch.setenv("FORETELL_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "--model", "m", "--max-queued-requests", "4"])
    assert args.api_key == "from-env" and args.max_queued_requests == 4
    assert args.host == "127.0.0.1" and args.port == 8000
    args = build_parser().parse_args(["serve", "--model", "m", "--api-key", "flag"])
    assert args.api_key == "flag"


def test_sigterm_aborts_streams_and_exits_zero(qwen3_checkpoint, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "FORETELL_API_KEY": "sekret", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "foretell.cli", "serve", "--model", qwen3_checkpoint, "--port", str(port),
         "--served-model-name", "tiny", "--num-kv-blocks", "300", "--max-model-len", "4096",
         "--no-access-log"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp_path),
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.1)
        body = {"model": "tiny", "prompt": "The cat", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        assert requests.post(url + "/v1/completions", json=body, timeout=5).status_code == 401
        auth = {"Authorization": "Bearer sekret"}
        with requests.post(url + "/v1/completions", json=body, headers=auth, stream=True, timeout=30) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line)
            assert first.startswith(b"data: {")
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]  # the stream ends by itself
        events = [json.loads(line[6:]) for line in rest[:-1]]
        assert rest[-1] == b"data: [DONE]"
        assert events[-1]["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(timeout=20) == 0
        with pytest.raises(requests.ConnectionError):
            requests.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert "refusing new requests" in (tmp_path / "serve.log").read_text()
