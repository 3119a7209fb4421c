"""The async front over the synchronous Engine: one engine thread, per-request output streams.

The Engine is single-threaded, so exactly one thread (the engine thread) ever touches it: it
builds the Engine (so /health can say when the model and KV cache are ready), then loops:
run the commands handed to it (add, abort, abort all, stop) between steps, call step(), and hand
the outputs to the asyncio event loop in one call_soon_threadsafe per step. The event loop side
owns the OutputStreams; nothing else is shared except the command queue and a stats snapshot.

The stats snapshot is taken when someone asks, not after every step: stats() returns the last
snapshot and asks for a new one after the next step, and fresh_stats() (what /metrics and /stats
await) gets one taken between two steps. The engine thread also takes one after a step that
finished a request (before its output goes out, so a client that saw its request finish sees it
counted) and when it goes idle. Other steps cost no stats work while nobody looks.

Outputs are cumulative (the whole text and token list so far), so a consumer that falls behind
only needs the latest output of each request: an OutputStream keeps just that.
A consumer that goes away aborts its requests, which frees their KV blocks at the next command
pass (within one step).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from foretell.config import EngineConfig
from foretell.engine.engine import Engine
from foretell.engine.outputs import RequestOutput
from foretell.runner.jit_counter import jit_compile_counter
from foretell.sampling_params import SamplingParams
from foretell.tokenizer import Tokenizer

logger = logging.getLogger("foretell.server")

# How long fresh_stats waits for the engine thread (a step in progress, then the snapshot) before
# it answers with the last snapshot: a scrape must not hang on an engine that stopped.
FRESH_STATS_TIMEOUT_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine failed to load or its thread stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine raised while running this request (a bug, not the client's fault)."""


@dataclass
class PromptSpec:
    """One engine request: an id, the prompt (text and/or token ids), its sampling params."""

    request_id: str
    prompt: str | list[int] | dict[str, Any]
    params: SamplingParams


@dataclass(eq=False)
class OutputStream:
    """The outputs of one or more engine requests (one per prompt of an API call), on the
    event loop. The consumer is done when `finished` (every request's final output read).

    Only the latest unread output of each request is kept: outputs are cumulative, so a stalled
    client costs one output per request, not one per step."""

    request_ids: list[str]
    in_engine: set[str] = field(default_factory=set)  # not finished in the engine yet
    without_output: set[str] = field(default_factory=set)  # queued: no token yet
    _unread: set[str] = field(default_factory=set)  # final output not read by the consumer yet
    _pending: dict[str, RequestOutput] = field(default_factory=dict)
    _error: BaseException | None = None
    _news: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.in_engine = set(self.request_ids)
        self.without_output = set(self.request_ids)
        self._unread = set(self.request_ids)

    @property
    def finished(self) -> bool:
        return not self._unread

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput):
            self.without_output.discard(item.request_id)
            if item.finished:
                self.in_engine.discard(item.request_id)
            self._pending[item.request_id] = item
        else:
            self.in_engine.clear()
            self.without_output.clear()
            self._error = item
        self._news.set()

    async def next_outputs(self) -> list[RequestOutput]:
        """Wait for news, then return the latest output of every request that has some.
        Raises what the engine raised for these requests."""
        while not self._pending and self._error is None:
            self._news.clear()
            await self._news.wait()
        if self._error is not None:
            self._unread.clear()
            raise self._error
        outputs = list(self._pending.values())
        self._pending.clear()
        for out in outputs:
            if out.finished:
                self._unread.discard(out.request_id)
        return outputs


class AsyncEngine:
    """Owns the engine thread. Build with a config; call start() from a running event loop."""

    def __init__(
        self,
        config: EngineConfig,
        engine_factory: Callable[[], Engine] | None = None,
        on_request_finished: Callable[[RequestOutput], None] | None = None,
    ):
        self.config = config
        self._engine_factory = engine_factory or (lambda: Engine(config))
        self.on_request_finished = on_request_finished
        self.on_fatal_error: Callable[[BaseException], None] | None = None
        # The front's own tokenizer (chat templates, prompt encoding, token strings); the engine
        # thread has its own, so the two threads never share one.
        self.tokenizer = Tokenizer(config.model.tokenizer or config.model.model)
        self.engine: Engine | None = None  # touched only by the engine thread once started
        self.max_model_len: int | None = None
        self.load_error: BaseException | None = None
        self.draining = False  # set on shutdown: refuse new requests
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, OutputStream] = {}  # event loop side only
        self._stats: dict[str, Any] = {}
        self._stats_wanted = False  # set by stats(): snapshot again after the next step
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle (event loop side) --------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="foretell-engine", daemon=True)
        self._thread.start()

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop that owns the streams (set by start())."""
        return self._loop

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and not self._stopped.is_set()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def begin_drain(self) -> None:
        """Stop taking requests and abort what is in flight. Safe from any thread."""
        self.draining = True
        self._send(("abort_all",))

    def begin_drain_from_signal_handler(self) -> None:
        """begin_drain for a signal handler, which may interrupt this very thread inside
        _send: take no lock here, let the event loop do it."""
        self.draining = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.begin_drain)

    async def stop(self) -> None:
        """Abort everything, stop the engine thread and wait for it."""
        self.draining = True
        self._send(("stop",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    # ---- requests (event loop side) ---------------------------------------------------
    @property
    def num_queued_requests(self) -> int:
        """Requests accepted that have no output token yet (waiting, or in prefill)."""
        return sum(len(s.without_output) for s in set(self._streams.values()))

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    async def add(self, prompts: list[PromptSpec]) -> OutputStream:
        """Add engine requests as one unit: all are queued, or (ValueError) none is."""
        if not self.is_ready:
            raise EngineDeadError(self.not_ready_reason())
        stream = OutputStream([p.request_id for p in prompts])
        for request_id in stream.request_ids:
            self._streams[request_id] = stream
        done: asyncio.Future = self._loop.create_future()
        self._send(("add", prompts, done))
        try:
            refusal = await done
        except asyncio.CancelledError:
            self.abort(stream)  # the add still runs in the engine thread: undo it there
            raise
        if refusal is not None:
            self._forget(stream)
            # A fresh exception, bound to no local: the frames its traceback holds (with the
            # prompts) form no reference cycle, so they are freed with the response.
            raise refusal[0](refusal[1])
        return stream

    def abort(self, stream: OutputStream) -> None:
        """Abort the stream's unfinished requests (no-op once all finished)."""
        unfinished = list(stream.in_engine)
        self._forget(stream)
        if unfinished:
            self._send(("abort", unfinished))

    def _forget(self, stream: OutputStream) -> None:
        for request_id in stream.request_ids:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]

    def stats(self) -> dict[str, Any]:
        """The engine's get_stats() as of the last snapshot (never blocks; safe from any
        thread). While the engine runs, asks for a new snapshot after the next step; an idle
        engine's snapshot was taken when it went idle."""
        self._stats_wanted = True
        return self._stats

    async def fresh_stats(self) -> dict[str, Any]:
        """The engine's get_stats() taken between two steps after this call (within one step),
        on the event loop; the last snapshot when the engine thread is not running."""
        if not self.is_ready:
            return self._stats
        done: asyncio.Future = self._loop.create_future()
        self._send(("stats", done))
        try:  # a stopping or dying engine thread may never answer: then the last snapshot
            return await asyncio.wait_for(done, FRESH_STATS_TIMEOUT_S)
        except asyncio.TimeoutError:
            return self._stats

    def not_ready_reason(self) -> str:
        if self.load_error is not None:
            return f"the engine failed to load: {self.load_error}"
        if self._stopped.is_set() or self.draining:
            return "the server is shutting down"
        return "the model is still loading"

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _dispatch(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """On the event loop: route the engine thread's outputs to their streams."""
        for request_id, item in items:
            stream = self._streams.get(request_id)
            finished = isinstance(item, BaseException) or item.finished
            if isinstance(item, RequestOutput) and item.finished and self.on_request_finished:
                try:
                    self.on_request_finished(item)
                except Exception:
                    logger.exception("on_request_finished hook failed")
            if stream is None:
                continue
            stream._put(item)
            if finished:
                self._streams.pop(request_id, None)

    # ---- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        jit_compile_counter()  # before the first kernel compiles: count from start-up
        try:
            self.engine = self._engine_factory()
            self.max_model_len = self.engine.max_model_len
            self._stats = self.engine.get_stats()
        except BaseException as e:  # a bad checkpoint, out of memory, ...
            logger.error("engine failed to load: %s", e)
            self.load_error = e
            self._stopped.set()
            if self.on_fatal_error is not None:
                self.on_fatal_error(e)
            return
        self._ready.set()
        logger.info("engine ready: max_model_len %d", self.max_model_len)
        try:
            self._loop_forever()
        except BaseException as e:
            logger.exception("engine thread died")
            if self.on_fatal_error is not None:
                self.on_fatal_error(e)
        finally:
            self._stopped.set()

    def _loop_forever(self) -> None:
        engine = self.engine
        while True:
            if not self._run_commands():
                return
            if not engine.has_unfinished_requests():
                self._stats = engine.get_stats()
                self._stats_wanted = False
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as e:
                logger.exception("engine step failed; aborting all in-flight requests")
                error = RequestFailedError(f"the engine failed while running the request: {e!r}")
                self._emit([(rid, error) for rid, _ in self._abort_all()])
                continue
            if self._stats_wanted or any(out.finished for out in outputs):
                # Before the outputs go out: whoever sees a request finish sees it counted.
                self._stats_wanted = False
                self._stats = engine.get_stats()
            if outputs:
                self._emit([(out.request_id, out) for out in outputs])

    def _run_commands(self) -> bool:
        """Run queued commands; False when told to stop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            kind = command[0]
            if kind == "add":
                self._add(command[1], command[2])
            elif kind == "abort":
                self._emit([(rid, out) for rid in command[1] if (out := self._abort(rid))])
            elif kind == "abort_all":
                self._emit(self._abort_all())
            elif kind == "stats":
                self._stats = self.engine.get_stats()
                self._loop.call_soon_threadsafe(_resolve, command[1], self._stats)
            elif kind == "stop":
                self._emit(self._abort_all())
                return False

    def _add(self, prompts: list[PromptSpec], done: asyncio.Future) -> None:
        """Add the prompts, all or none; resolves `done` with None, or with the (exception
        type, message) of the refusal (a message, not the exception: see add)."""
        added: list[str] = []
        refusal = None
        try:
            for spec in prompts:
                self.engine.add_request(spec.request_id, spec.prompt, spec.params)
                added.append(spec.request_id)
        except ValueError as e:
            refusal = (ValueError, f"prompt {len(added)}: {e}" if len(prompts) > 1 else str(e))
        except BaseException as e:
            logger.error("add_request failed: %s", "".join(traceback.format_exception(e)))
            refusal = (RequestFailedError, f"the engine could not add the request: {e!r}")
        if refusal is not None:
            for request_id in added:
                self.engine.abort_request(request_id)
        self._loop.call_soon_threadsafe(_resolve, done, refusal)

    def _abort(self, request_id: str) -> RequestOutput | None:
        try:
            return self.engine.abort_request(request_id)
        except Exception:
            logger.exception("abort of %s failed", request_id)
            return None

    def _abort_all(self) -> list[tuple[str, RequestOutput]]:
        """Abort every request in the engine; their final outputs say finish_reason "abort"."""
        aborted = []
        for request_id in list(self.engine.requests):
            out = self._abort(request_id)
            if out is not None:
                aborted.append((request_id, out))
        return aborted

    def _emit(self, items: list[tuple[str, Any]]) -> None:
        if items:
            self._loop.call_soon_threadsafe(self._dispatch, items)


def _resolve(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)
