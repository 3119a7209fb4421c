"""What the endpoints do: turn a validated OpenAI request into engine requests, and the engine's
final outputs into an OpenAI response (streams: see streaming.py).

One API call becomes one engine request per prompt (each with n sequences); choice index
i * n + j is prompt i's j-th sample, as OpenAI numbers them. A client that hangs up before its
non-streaming response is ready has its requests aborted.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from foretell.engine.outputs import CompletionOutput, RequestOutput
from foretell.engine.sequence import Logprob
from foretell.sampling_params import SamplingParams
from foretell.server.async_engine import AsyncEngine, EngineDeadError, OutputStream, PromptSpec
from foretell.server.async_engine import RequestFailedError
from foretell.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from foretell.server.protocol import SamplingRequestFields, usage
from foretell.server.streaming import Delta, sse_response

GREEDY_EPS = 1e-5  # temperatures below this sample greedily (dividing logits by ~0 overflows)
LOGPROB_FLOOR = -9999.0  # stands in for -inf / NaN, which JSON cannot carry


@dataclass
class ServingContext:
    engine: AsyncEngine
    model_name: str
    max_queued_requests: int | None = None
    _token_strings: dict[int, str] = field(default_factory=dict)

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested not in (self.model_name, self.engine.config.model.model):
            raise APIError(404, f"the model {requested!r} does not exist; this server serves "
                           f"{self.model_name!r}", "not_found_error", "model", "model_not_found")

    def token_string(self, token_id: int) -> str:
        text = self._token_strings.get(token_id)
        if text is None:
            text = self.engine.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_strings[token_id] = text
        return text

    async def submit(self, prompts: list[PromptSpec], param: str) -> OutputStream:
        engine = self.engine
        if engine.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable", code="shutting_down")
        if self.max_queued_requests is not None and (
            engine.num_queued_requests + len(prompts) > self.max_queued_requests
        ):
            raise APIError(503, f"the server is overloaded: more than {self.max_queued_requests} "
                           f"requests are queued; retry shortly", "service_unavailable",
                           code="overloaded", headers={"Retry-After": "1"})
        try:
            return await engine.add(prompts)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable", code="not_ready") from None
        except RequestFailedError as e:
            raise APIError(500, str(e), "internal_server_error") from None


def sampling_params(req: SamplingRequestFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    unsupported = {
        "presence_penalty": req.presence_penalty not in (None, 0.0),
        "frequency_penalty": req.frequency_penalty not in (None, 0.0),
        "repetition_penalty": req.repetition_penalty not in (None, 1.0),
        "logit_bias": bool(req.logit_bias),
    }
    for name, given in unsupported.items():
        if given:
            raise APIError(400, f"{name} is not supported by this server; leave it unset", param=name)
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


# ---------------------------------------------------------------------------------- completion


def completion_prompts(req: CompletionRequest, ctx: ServingContext, request_id: str) -> tuple[list[PromptSpec], list[str]]:
    """Engine prompts of a completion request, and each prompt's text (for echo)."""
    raw = req.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]
    scores_prompt = req.echo and req.logprobs is not None
    if scores_prompt and req.stream:
        raise APIError(400, "echo with logprobs (prompt scoring) is supported without streaming; "
                       "set stream to false", param="echo")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (only best_of == n)", param="best_of")
    if req.suffix:
        raise APIError(400, "suffix is not supported by this server", param="suffix")
    params = sampling_params(req, req.max_tokens, req.logprobs)
    if scores_prompt:
        params = replace(params, prompt_logprobs=req.logprobs)
    specs, texts = [], []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            if not item:
                raise APIError(400, f"prompt {i} is an empty string", param="prompt")
            token_ids = ctx.engine.tokenizer.encode(item)
            if not token_ids:
                raise APIError(400, f"prompt {i} encodes to no tokens", param="prompt")
            text = item
        else:
            token_ids = list(item)
            text = ctx.engine.tokenizer.decode(token_ids, skip_special_tokens=False) if req.echo else ""
        specs.append(PromptSpec(f"{request_id}-{i}", {"prompt": text or None, "prompt_token_ids": token_ids}, params))
        texts.append(text)
    return specs, texts


def completion_logprobs(ctx: ServingContext, logprobs: list[Logprob], offset: int) -> dict[str, Any]:
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for lp in logprobs:
        token = ctx.token_string(lp.token_id)
        tokens.append(token)
        token_logprobs.append(finite(lp.logprob))
        top = {ctx.token_string(t): finite(v) for t, v in lp.top.items()}
        top.setdefault(token, finite(lp.logprob))
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def echo_logprobs(ctx: ServingContext, out, completion: dict | None) -> dict:
    """OpenAI's echo + logprobs layout: the prompt's tokens (the first without a log-prob), then
    the completion's, with text offsets running through both."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = 0
    for token_id, lp in zip(out.prompt_token_ids, out.prompt_logprobs):
        token = ctx.token_string(token_id)
        tokens.append(token)
        text_offset.append(offset)
        offset += len(token)
        if lp is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(finite(lp.logprob))
        top = {ctx.token_string(t): finite(v) for t, v in lp.top.items()}
        top.setdefault(token, finite(lp.logprob))
        top_logprobs.append(top)
    merged = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
              "text_offset": text_offset}
    if completion is not None:
        for key in merged:
            merged[key] = merged[key] + completion[key]
    return merged


async def create_completion(req: CompletionRequest, ctx: ServingContext, raw: Request):
    ctx.check_model(req.model)
    request_id = new_id("cmpl")
    specs, prompt_texts = completion_prompts(req, ctx, request_id)
    stream = await ctx.submit(specs, "prompt")
    index_of = {spec.request_id: i for i, spec in enumerate(specs)}
    base = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": ctx.model_name}
    echo = prompt_texts if req.echo else [""] * len(specs)

    def choice(prompt_index: int, c: CompletionOutput, text: str, new_logprobs, offset: int) -> dict:
        return {
            "index": prompt_index * req.n + c.index,
            "text": text,
            "logprobs": completion_logprobs(ctx, new_logprobs, offset) if new_logprobs is not None else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    if req.stream:
        def chunk(rid: str, c: CompletionOutput, delta: Delta) -> dict | None:
            i = index_of[rid]
            text = (echo[i] if delta.first else "") + delta.text
            if not text and delta.logprobs is None and delta.finish_reason is None:
                return None
            ch = choice(i, c, text, delta.logprobs, delta.text_offset)
            ch["finish_reason"], ch["stop_reason"] = delta.finish_reason, delta.stop_reason
            return {**base, "choices": [ch]}

        return sse_response(stream, lambda: ctx.engine.abort(stream), req, chunk, base, req.logprobs is not None)

    finals = await collect_finals(ctx, stream, raw)
    choices = []
    for out in sorted(finals, key=lambda o: index_of[o.request_id]):
        i = index_of[out.request_id]
        for c in out.outputs:
            logprobs = c.logprobs if req.logprobs is not None else None
            ch = choice(i, c, echo[i] + c.text, logprobs, len(echo[i]))
            if req.echo and req.logprobs is not None:
                ch["logprobs"] = echo_logprobs(ctx, out, ch["logprobs"])
            choices.append(ch)
    return JSONResponse({**base, "choices": choices, "usage": usage(finals)})


# ---------------------------------------------------------------------------------------- chat


def chat_prompt(req: ChatCompletionRequest, ctx: ServingContext) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        return ctx.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
    except ValueError as e:
        raise APIError(400, str(e), param="messages", code="no_chat_template") from None
    except Exception as e:  # a template can raise anything (jinja2 errors, raise_exception(...))
        raise APIError(400, f"the chat template failed on these messages: {e}", param="messages") from None


def chat_logprobs(ctx: ServingContext, logprobs: list[Logprob], num_top: int) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = ctx.token_string(token_id)
        return {"token": token, "logprob": finite(logprob), "bytes": list(token.encode("utf-8"))}

    content = []
    for lp in logprobs:
        top = sorted(lp.top.items(), key=lambda kv: -kv[1])[:num_top]
        content.append({**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in top]})
    return {"content": content}


async def create_chat_completion(req: ChatCompletionRequest, ctx: ServingContext, raw: Request):
    ctx.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    num_top = req.top_logprobs or 0
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, max_tokens, num_top if req.logprobs else None)
    request_id = new_id("chatcmpl")
    prompt = {"prompt_token_ids": chat_prompt(req, ctx)}
    stream = await ctx.submit([PromptSpec(request_id, prompt, params)], "messages")
    base = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": ctx.model_name}

    def logprobs_of(lps: list[Logprob] | None) -> dict | None:
        return chat_logprobs(ctx, lps, num_top) if req.logprobs and lps is not None else None

    if req.stream:
        chunk_base = {**base, "object": "chat.completion.chunk"}

        def chunk(rid: str, c: CompletionOutput, delta: Delta) -> dict | None:
            message = {"role": "assistant", "content": delta.text} if delta.first else {"content": delta.text}
            if not delta.first and not delta.text and delta.logprobs is None and delta.finish_reason is None:
                return None
            if delta.finish_reason is not None and not delta.text and not delta.first:
                message = {}
            ch = {"index": c.index, "delta": message, "logprobs": logprobs_of(delta.logprobs),
                  "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
            return {**chunk_base, "choices": [ch]}

        return sse_response(stream, lambda: ctx.engine.abort(stream), req, chunk, chunk_base, req.logprobs)

    finals = await collect_finals(ctx, stream, raw)
    choices = [
        {"index": c.index, "message": {"role": "assistant", "content": c.text},
         "logprobs": logprobs_of(c.logprobs), "finish_reason": c.finish_reason,
         "stop_reason": c.stop_reason}
        for out in finals for c in out.outputs
    ]
    return JSONResponse({**base, "choices": choices, "usage": usage(finals)})


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
