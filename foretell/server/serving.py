"""What the endpoints share: the ServingContext (the engine, the model's name, the front
tokenizer's thread, the checks every request passes before the engine takes it), a request's
SamplingParams, and the final outputs a non-streaming response is built from. The endpoints
themselves turn a validated OpenAI request into engine requests, and the engine's final outputs
into an OpenAI response: serving_completion.py (/v1/completions) and serving_chat.py
(/v1/chat/completions); streams: see streaming.py.

A client that hangs up before its non-streaming response is ready has its requests aborted
(collect_finals).

Tokenization never runs on the event loop: a prompt (or chat) longer in characters than
max_model_len tokens could possibly span is refused before it is tokenized, and the rest is
tokenized on the context's one tokenizer thread (the fast tokenizer releases the GIL), so a
megabyte prompt stalls no other stream.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from starlette.requests import Request

from foretell.engine.outputs import CompletionOutput, RequestOutput
from foretell.sampling_params import SamplingParams
from foretell.server.async_engine import AsyncEngine, EngineDeadError, OutputStream, PromptSpec
from foretell.server.async_engine import RequestFailedError
from foretell.server.protocol import APIError, SamplingRequestFields
from foretell.server.streaming import request_failure
from foretell.server.tool_calls import structured_outputs_of
from foretell.server.tool_parsers import check_tool_call_parser
from foretell.server.token_origins import origins_json

GREEDY_EPS = 1e-5  # temperatures below this sample greedily (dividing logits by ~0 overflows)
LOGPROB_FLOOR = -9999.0  # stands in for -inf / NaN, which JSON cannot carry


@dataclass
class ServingContext:
    engine: AsyncEngine
    model_name: str
    max_queued_requests: int | None = None
    _token_strings: dict[int, str] = field(default_factory=dict)
    # One thread for the front tokenizer's heavy work (encode, chat templates, echo decodes):
    # off the event loop, and never two encodes racing on one tokenizer.
    _tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="foretell-tokenizer"))
    chars_per_token_bound: int = 0  # 0: measured from the tokenizer's vocabulary
    # Which format tool calls are parsed (and forced) in: tool_parsers.TOOL_CALL_PARSERS; "auto":
    # the chat template's (--tool-call-parser).
    tool_call_parser: str = "auto"

    def __post_init__(self) -> None:
        check_tool_call_parser(self.tool_call_parser)
        if not self.chars_per_token_bound:
            self.chars_per_token_bound = longest_token_chars(self.engine.tokenizer)

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    async def on_tokenizer_thread(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def check_ready(self) -> None:
        """503 before any work on a request the engine could not take anyway."""
        if self.engine.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable", code="shutting_down")
        if not self.engine.is_ready or self.engine.max_model_len is None:
            raise APIError(503, self.engine.not_ready_reason(), "service_unavailable", code="not_ready")

    def check_prompt_chars(self, num_chars: int, what: str, param: str) -> None:
        """400 at once for text that cannot fit max_model_len tokens, before tokenizing it: no
        token of this tokenizer stands for more than chars_per_token_bound characters."""
        max_model_len = self.engine.max_model_len
        limit = max_model_len * self.chars_per_token_bound
        if num_chars > limit:
            raise APIError(
                400, f"{what} is {num_chars} characters: more than {max_model_len} tokens "
                f"(max_model_len) of this tokenizer can hold (at most {self.chars_per_token_bound} "
                f"characters a token, so at most {limit} characters); shorten it",
                param=param, code="prompt_too_long")

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested not in (self.model_name, self.engine.config.model.model):
            raise APIError(404, f"the model {requested!r} does not exist; this server serves "
                           f"{self.model_name!r}", "not_found_error", "model", "model_not_found")

    def origins_json(self, c: CompletionOutput, origins: list | None) -> list[dict]:
        """The wire form of a choice's newest token origins (server/token_origins.py)."""
        decode = lambda ids: self.engine.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        return origins_json(origins or [], c.token_ids, decode, self.token_string, c.finished)

    def token_string(self, token_id: int) -> str:
        text = self._token_strings.get(token_id)
        if text is None:
            text = self.engine.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_strings[token_id] = text
        return text

    async def submit(self, prompts: list[PromptSpec], param: str) -> OutputStream:
        engine = self.engine
        self.check_ready()
        if self.max_queued_requests is not None and (
            engine.num_queued_requests + len(prompts) > self.max_queued_requests
        ):
            raise APIError(503, f"the server is overloaded: more than {self.max_queued_requests} "
                           f"requests are queued; retry shortly", "service_unavailable",
                           code="overloaded", headers={"Retry-After": "1"})
        try:
            return await engine.add(prompts)
        except ValueError as e:  # the engine's checks; a SamplingParams field's names the field
            field = re.match(r"SamplingParams\.(\w+) ", str(e))
            raise APIError(400, str(e), param=field.group(1) if field else param) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable", code="not_ready") from None
        except RequestFailedError as e:
            raise APIError(500, str(e), "internal_server_error") from None


def longest_token_chars(tokenizer) -> int:
    """The most characters one token's vocabulary string has. Byte-level BPE spells each byte as
    one character and sentencepiece each character as itself, so no token decodes to more
    characters than this (a normalizer that merges characters aside)."""
    vocab = tokenizer.hf.get_vocab()
    return max(1, max((len(token) for token in vocab), default=1))


def sampling_params(req: SamplingRequestFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    temperature = 1.0 if req.temperature is None else req.temperature
    try:
        return SamplingParams(
            n=req.n,
            temperature=0.0 if temperature < GREEDY_EPS else temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            max_tokens=max_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            structured_outputs=structured_outputs_of(req),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            min_tokens=req.min_tokens,
            logit_bias=None if req.logit_bias is None else {int(t): b for t, b in req.logit_bias.items()},
            bad_words=req.bad_words,
            allowed_token_ids=req.allowed_token_ids,
            return_token_origins=req.return_token_origins,
            use_speculation=req.use_speculation,
        )
    except ValueError as e:
        match = re.match(r"SamplingParams\.(\w+) (.*)", str(e))
        if match:
            raise APIError(400, f"{match.group(1)} {match.group(2)}", param=match.group(1)) from None
        raise APIError(400, str(e)) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finite(x: float) -> float:
    return x if x == x and x > LOGPROB_FLOOR else LOGPROB_FLOOR  # x == x is False for NaN


# ------------------------------------------------------------------------- collecting outputs


async def wait_for_disconnect(raw: Request) -> None:
    """Returns when the client hangs up (the request body has been read already)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_finals(ctx: ServingContext, stream: OutputStream, raw: Request) -> list[RequestOutput]:
    """The final output of each request of the stream; aborts them if the client hangs up."""
    finals: dict[str, RequestOutput] = {}

    async def collect() -> None:
        while not stream.finished:
            for out in await stream.next_outputs():
                failure = request_failure(out)
                if failure is not None:  # this request alone failed in the engine
                    raise RequestFailedError(failure)
                if out.finished:
                    finals[out.request_id] = out

    collector = asyncio.ensure_future(collect())
    hangup = asyncio.ensure_future(wait_for_disconnect(raw))
    try:
        await asyncio.wait({collector, hangup}, return_when=asyncio.FIRST_COMPLETED)
        if not collector.done():
            raise APIError(499, "the client closed the connection", "client_closed_request")
        try:
            collector.result()
        except RequestFailedError as e:
            raise APIError(500, str(e), "internal_server_error") from None
    finally:
        collector.cancel()
        hangup.cancel()
        ctx.engine.abort(stream)  # no-op when everything finished
    if any(c.finish_reason == "abort" for out in finals.values() for c in out.outputs):
        raise APIError(503, "the request was aborted: the server is shutting down",
                       "service_unavailable", code="shutting_down")
    return [finals[rid] for rid in stream.request_ids]
