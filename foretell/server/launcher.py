"""Running the app under uvicorn: in the foreground with clean signal handling (`foretell serve`),
or in a background thread on a free port (tests, notebooks).

On SIGTERM or Ctrl+C, GracefulServer first drains the engine (no new requests, in-flight ones
aborted, so open streams end at once), then lets uvicorn close the listening socket and the
connections, and the lifespan stop the engine thread. If the engine dies, the server exits 1.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Callable

import uvicorn

from foretell.server.async_engine import AsyncEngine

if TYPE_CHECKING:
    from foretell.config import EngineConfig
    from foretell.engine.engine import Engine

logger = logging.getLogger("foretell.server")


def describe_loaded_engine(engine: "Engine", served_model_name: str) -> str:
    """One line: what the server runs (model, drafter, dtype, device), for the start-up log."""
    config = engine.config
    spec = config.speculative
    if spec is None:
        drafter = "no speculation"
    else:
        source = f" {spec.model}" if spec.model else ""
        drafter = f"{spec.method}{source}, k={spec.num_speculative_tokens}"
    runner = engine.runner
    dtype = str(runner.dtype).replace("torch.", "")
    return (f"loaded model {config.model.model} (served as {served_model_name!r}), drafter: "
            f"{drafter}, dtype {dtype}, device {runner.device}, max_model_len {engine.max_model_len}")


def engine_factory_that_logs(config: "EngineConfig", served_model_name: str) -> Callable[[], "Engine"]:
    """Engine(config), logging describe_loaded_engine once it has loaded (in the engine thread)."""

    def build() -> "Engine":
        from foretell.engine.engine import Engine

        engine = Engine(config)
        logger.info("%s", describe_loaded_engine(engine, served_model_name))
        return engine

    return build


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.exit_code = 0
        async_engine.on_fatal_error = self._on_engine_fatal

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:
            logger.info("signal %d: refusing new requests, aborting in-flight ones", sig)
        self.async_engine.begin_drain_from_signal_handler()
        super().handle_exit(sig, frame)

    def _on_engine_fatal(self, error: BaseException) -> None:
        logger.error("the engine stopped (%s); shutting the server down", error)
        self.exit_code = 1
        self.should_exit = True


def serve_forever(app, async_engine: AsyncEngine, host: str, port: int, **uvicorn_kwargs) -> int:
    """Serve in the foreground until SIGTERM/SIGINT; returns the process exit code."""
    server = GracefulServer(uvicorn.Config(app, host=host, port=port, **uvicorn_kwargs), async_engine)
    # uvicorn re-raises the signal it caught once it has shut down, under the handlers that were
    # installed before it started: make those no-ops so that a clean shutdown exits 0.
    previous = {sig: signal.signal(sig, _after_shutdown) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return server.exit_code


def _after_shutdown(signum: int, frame) -> None:
    logger.info("server stopped after signal %d", signum)


class BackgroundServer:
    """uvicorn in a daemon thread on 127.0.0.1 and a free port; stop() shuts it down cleanly."""

    def __init__(self, app, async_engine: AsyncEngine, host: str = "127.0.0.1", **uvicorn_kwargs):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.host, self.port = self.sock.getsockname()
        uvicorn_kwargs.setdefault("log_level", "warning")
        uvicorn_kwargs.setdefault("timeout_graceful_shutdown", 5)
        config = uvicorn.Config(app, **uvicorn_kwargs)
        self.server = GracefulServer(config, async_engine)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="foretell-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.async_engine.begin_drain()
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
