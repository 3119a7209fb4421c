"""Server fixtures: real servers on 127.0.0.1 shared by the server tests (see server_helpers).
The server modules are imported lazily, so collection works without the `server` extra."""

from __future__ import annotations

import pytest


def _start(*args, **kwargs):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from server_helpers import start_server

    return start_server(*args, **kwargs)


@pytest.fixture(scope="session")
def server(qwen3_checkpoint):
    """The plain server (no speculative decoding) most tests share."""
    srv = _start(qwen3_checkpoint)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def spec_server(qwen3_checkpoint):
    """The same model with n-gram speculative decoding."""
    srv = _start(qwen3_checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    yield srv
    srv.stop()


@pytest.fixture
def server_factory():
    """Start servers with special settings; all are stopped after the test."""
    started = []

    def make(*args, **kwargs):
        srv = _start(*args, **kwargs)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread while these tests run. The tiny models' ops are far too small to gain
    from threads, and on a 2-core machine the OpenMP workers fight the server's event loop and
    the in-process clients for the cores: with 2 threads the engine runs ~10x slower here."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
