"""Helpers for the server tests: start a real uvicorn server on 127.0.0.1 over a tiny checkpoint
(free port, background thread), and wait for the engine to be idle."""

from __future__ import annotations

import time

import torch

from foretell.config import build_engine_config
from foretell.engine.engine import Engine
from foretell.server.api import build_app
from foretell.server.async_engine import AsyncEngine
from foretell.server.launcher import BackgroundServer

MODEL_NAME = "tiny-qwen3"
ENGINE_KWARGS = {"num_kv_blocks": 160, "max_model_len": 512, "log_stats_interval_s": 0.0}


def start_server(
    model: str,
    *,
    api_key: str | None = None,
    max_queued_requests: int | None = None,
    engine_factory=None,
    wait_ready: bool = True,
    ui: bool = True,
    **engine_kwargs,
) -> BackgroundServer:
    kwargs = {**ENGINE_KWARGS, **engine_kwargs}
    config = build_engine_config(model, **kwargs)
    factory = engine_factory or (lambda: Engine(config))

    def build_in_engine_thread() -> Engine:
        torch.set_num_threads(1)  # see conftest.one_torch_thread: per thread, so set it here too
        return factory()

    async_engine = AsyncEngine(config, engine_factory=build_in_engine_thread)
    app = build_app(async_engine, MODEL_NAME, api_key=api_key, max_queued_requests=max_queued_requests, ui=ui)
    server = BackgroundServer(app, async_engine).start()
    if wait_ready and not async_engine.wait_ready(timeout=60):
        server.stop()
        raise RuntimeError(f"engine did not load: {async_engine.load_error}")
    return server


def engine_stats(srv: BackgroundServer) -> dict:
    return srv.server.async_engine.stats()


def wait_until_idle(srv: BackgroundServer, timeout: float = 20.0) -> dict:
    """Wait until the engine has no request and every KV block is free; returns the stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(srv)
        idle = (
            stats.get("num_requests_running") == 0
            and stats.get("num_requests_waiting") == 0
            and stats.get("num_free_kv_blocks") == stats.get("num_kv_blocks")
            and srv.server.async_engine.num_unfinished_requests == 0
        )
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def counter_deltas(before: list[int], after: list[int]) -> list[int]:
    """after - before for a per-position counter list of the stats. The lists grow past k when a
    verify accepts more (grammar-forced drafts of a structured request, in any test that shared the
    server): positions that `before` lacks count from 0."""
    before = before + [0] * (len(after) - len(before))
    return [a - b for b, a in zip(before, after)]
