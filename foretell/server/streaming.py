"""Server-Sent Events for streaming completions and chat: per-choice deltas of the engine's
cumulative outputs, in OpenAI's chunk format, ending with `data: [DONE]`.

While a stop string could still be completing, the last (longest stop - 1) characters of a
choice are held back, so a client never sees text that the stop string later cuts. However the
response ends (finished, client gone, error), its engine requests are aborted if still running.
A request the engine failed (alone, inside a step) ends its stream with an error event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.responses import StreamingResponse

from foretell.engine.outputs import CompletionOutput, RequestOutput
from foretell.engine.sequence import Logprob
from foretell.engine.token_origins import TokenOrigin
from foretell.server.async_engine import OutputStream, RequestFailedError
from foretell.server.protocol import APIError, SamplingRequestFields, usage


@dataclass
class Delta:
    """What one choice gained since its last chunk."""

    first: bool
    text: str
    text_offset: int
    logprobs: list[Logprob] | None
    finish_reason: str | None
    stop_reason: str | int | None
    token_origins: list[TokenOrigin] | None = None  # the new tokens' (return_token_origins)


@dataclass
class ChoiceProgress:
    sent_chars: int = 0
    sent_tokens: int = 0
    started: bool = False
    done: bool = False

    def advance(self, c: CompletionOutput, hold: int, want_logprobs: bool) -> Delta | None:
        if self.done:
            return None
        end = len(c.text) if c.finished else max(self.sent_chars, len(c.text) - hold)
        text, offset = c.text[self.sent_chars:end], self.sent_chars
        logprobs = None
        if want_logprobs and c.logprobs is not None:
            logprobs = c.logprobs[self.sent_tokens:]
        origins = c.token_origins[self.sent_tokens:] if c.token_origins is not None else None
        first = not self.started
        self.started, self.sent_chars, self.sent_tokens = True, end, len(c.token_ids)
        self.done = c.finished
        return Delta(first, text, offset, logprobs or None, c.finish_reason, c.stop_reason, origins or None)


def request_failure(out: RequestOutput) -> str | None:
    """What went wrong when the engine failed this request inside a step (its output is then
    final, with finish_reason "error"); None for a request that did not fail. Other requests of
    that step go on: only this request's response ends with the error."""
    return out.error


def holdback(req: SamplingRequestFields) -> int:
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    return max((len(s) for s in stops), default=1) - 1


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def sse_response(
    stream: OutputStream,
    abort: Callable[[], None],
    req: SamplingRequestFields,
    make_chunk: Callable[[str, CompletionOutput, Delta], dict | None],
    base: dict,
    want_logprobs: bool,
) -> StreamingResponse:
    """make_chunk(request_id, choice, delta) builds one chunk (None: nothing worth sending);
    base holds the id/object/created/model fields of the final usage chunk."""
    hold = holdback(req)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def events() -> AsyncIterator[str]:
        progress: dict[tuple[str, int], ChoiceProgress] = {}
        latest: dict[str, RequestOutput] = {}
        try:
            while not stream.finished:
                for out in await stream.next_outputs():
                    failure = request_failure(out)
                    if failure is not None:  # this request alone failed in the engine
                        raise RequestFailedError(failure)
                    latest[out.request_id] = out
                    for c in out.outputs:
                        delta = progress.setdefault((out.request_id, c.index), ChoiceProgress()).advance(
                            c, hold, want_logprobs)
                        chunk = make_chunk(out.request_id, c, delta) if delta else None
                        if chunk is not None:
                            if include_usage:
                                chunk["usage"] = None
                            yield sse(chunk)
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage([latest[r] for r in stream.request_ids if r in latest])})
        except RequestFailedError as e:
            yield sse(APIError(500, str(e), "internal_server_error").body())
        finally:
            abort()  # no-op when all finished; else the client left: free the KV blocks now
        yield sse("[DONE]")

    return AbortOnCloseStreamingResponse(
        events(), on_close=abort, media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


class AbortOnCloseStreamingResponse(StreamingResponse):
    """Runs on_close however the response ends, even when the client hangs up before the body
    generator ever started (its own `finally` would then never run)."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
