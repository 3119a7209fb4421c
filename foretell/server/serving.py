"""What the endpoints do: turn a validated OpenAI request into engine requests, and the engine's
final outputs into an OpenAI response (streams: see streaming.py).

One API call becomes one engine request per prompt (each with n sequences); choice index
i * n + j is prompt i's j-th sample, as OpenAI numbers them. A client that hangs up before its
non-streaming response is ready has its requests aborted.

Tokenization never runs on the event loop: a prompt (or chat) longer in characters than
max_model_len tokens could possibly span is refused before it is tokenized, and the rest is
tokenized on the context's one tokenizer thread (the fast tokenizer releases the GIL), so a
megabyte prompt stalls no other stream.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
from foretell.server.streaming import Delta, request_failure, sse_response
from foretell.server.tool_calls import ToolCallStream, ToolPlan, chat_message, message_dicts, plan_tools
from foretell.server.tool_calls import render_with_tools, structured_outputs_of
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


# ---------------------------------------------------------------------------------- completion


async def completion_prompts(req: CompletionRequest, ctx: ServingContext, request_id: str) -> tuple[list[PromptSpec], list[str]]:
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
    ctx.check_ready()
    max_model_len = ctx.engine.max_model_len
    for i, item in enumerate(raw):
        if isinstance(item, str):
            if not item:
                raise APIError(400, f"prompt {i} is an empty string", param="prompt")
            ctx.check_prompt_chars(len(item), f"prompt {i}", "prompt")
        elif len(item) >= max_model_len:
            raise APIError(400, f"prompt {i} is {len(item)} tokens, but max_model_len is "
                           f"{max_model_len}: shorten the prompt", param="prompt", code="prompt_too_long")
    tokenized = await ctx.on_tokenizer_thread(tokenize_prompts, ctx.engine.tokenizer, raw, req.echo)
    specs, texts = [], []
    for i, (token_ids, text) in enumerate(tokenized):
        if not token_ids:
            raise APIError(400, f"prompt {i} encodes to no tokens", param="prompt")
        specs.append(PromptSpec(f"{request_id}-{i}", {"prompt": text or None, "prompt_token_ids": token_ids}, params))
        texts.append(text)
    return specs, texts


def tokenize_prompts(tokenizer, prompts: list, decode_ids: bool) -> list[tuple[list[int], str]]:
    """On the tokenizer thread: (token ids, text) of each prompt; token-id prompts get their
    text only when asked (echo)."""
    out = []
    for item in prompts:
        if isinstance(item, str):
            out.append((tokenizer.encode(item), item))
        else:
            text = tokenizer.decode(item, skip_special_tokens=False) if decode_ids else ""
            out.append((list(item), text))
    return out


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
    specs, prompt_texts = await completion_prompts(req, ctx, request_id)
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
            if not text and delta.logprobs is None and delta.finish_reason is None and delta.token_origins is None:
                return None
            ch = choice(i, c, text, delta.logprobs, delta.text_offset)
            ch["finish_reason"], ch["stop_reason"] = delta.finish_reason, delta.stop_reason
            if req.return_token_origins:
                ch["token_origins"] = ctx.origins_json(c, delta.token_origins)
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
            if req.return_token_origins:
                ch["token_origins"] = ctx.origins_json(c, c.token_origins)
            choices.append(ch)
    return JSONResponse({**base, "choices": choices, "usage": usage(finals)})


# ---------------------------------------------------------------------------------------- chat


async def chat_prompt(req: ChatCompletionRequest, ctx: ServingContext, tools: list[dict] | None = None) -> list[int]:
    messages = message_dicts(req)
    ctx.check_ready()
    ctx.check_prompt_chars(sum(len(m["content"]) for m in messages), "the messages' content", "messages")
    return await ctx.on_tokenizer_thread(render_chat, ctx.engine.tokenizer, messages, req.add_generation_prompt, tools)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
    """On the tokenizer thread: the chat template's token ids, or a 400 naming the failure."""
    code = None
    try:
        if tools:
            return render_with_tools(tokenizer, messages, add_generation_prompt, tools)
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except ValueError as e:  # the tokenizer has no chat template
        message, code = str(e), "no_chat_template"
    except Exception as e:  # a template can raise anything (jinja2 errors, raise_exception(...))
        message = f"the chat template failed on these messages: {e}"
    # Raised outside the except blocks, so the error carries no template traceback (whose frames
    # hold the messages) and no reference cycle keeps them alive after the response.
    raise APIError(400, message, param="messages", code=code)


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
    plan = plan_tools(req, getattr(ctx.engine.tokenizer.hf, "chat_template", None), ctx.tool_call_parser)
    if plan.constraint is not None:  # tool_choice required or named: the call's grammar
        params = replace(params, structured_outputs=plan.constraint)
    request_id = new_id("chatcmpl")
    prompt = {"prompt_token_ids": await chat_prompt(req, ctx, plan.tools)}
    stream = await ctx.submit([PromptSpec(request_id, prompt, params)], "messages")
    base = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": ctx.model_name}

    def logprobs_of(lps: list[Logprob] | None) -> dict | None:
        return chat_logprobs(ctx, lps, num_top) if req.logprobs and lps is not None else None

    if req.stream:
        chunk_base = {**base, "object": "chat.completion.chunk"}
        tool_streams: dict[int, ToolCallStream] = {}

        def chunk(rid: str, c: CompletionOutput, delta: Delta) -> dict | None:
            if plan.active:
                return tool_chunk(chunk_base, c, delta, tool_streams.setdefault(c.index, ToolCallStream(plan.parser)),
                                  logprobs_of(delta.logprobs))
            message = {"role": "assistant", "content": delta.text} if delta.first else {"content": delta.text}
            if (not delta.first and not delta.text and delta.logprobs is None
                    and delta.finish_reason is None and delta.token_origins is None):
                return None
            if delta.finish_reason is not None and not delta.text and not delta.first:
                message = {}
            ch = {"index": c.index, "delta": message, "logprobs": logprobs_of(delta.logprobs),
                  "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
            if req.return_token_origins:
                ch["token_origins"] = ctx.origins_json(c, delta.token_origins)
            return {**chunk_base, "choices": [ch]}

        return sse_response(stream, lambda: ctx.engine.abort(stream), req, chunk, chunk_base, req.logprobs)

    finals = await collect_finals(ctx, stream, raw)
    choices = [final_chat_choice(c, plan, logprobs_of(c.logprobs)) for out in finals for c in out.outputs]
    if req.return_token_origins:
        for ch, c in zip(choices, (c for out in finals for c in out.outputs)):
            ch["token_origins"] = ctx.origins_json(c, c.token_origins)
    return JSONResponse({**base, "choices": choices, "usage": usage(finals)})


def final_chat_choice(c: CompletionOutput, plan: ToolPlan, logprobs: dict | None) -> dict:
    message, called = chat_message(c.text, plan)
    finish = "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason
    return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish,
            "stop_reason": c.stop_reason}


def tool_chunk(base: dict, c: CompletionOutput, delta: Delta, tools: ToolCallStream, logprobs: dict | None) -> dict | None:
    """A chat chunk of a request whose output is parsed for tool calls (server/tool_calls.py)."""
    finished = delta.finish_reason is not None
    content, calls = tools.feed(delta.text, finished)
    message = {"role": "assistant"} if delta.first else {}
    if content:
        message["content"] = content
    if calls:
        message["tool_calls"] = calls
    if not message and logprobs is None and not finished:
        return None
    finish = "tool_calls" if finished and tools.called and delta.finish_reason == "stop" else delta.finish_reason
    return {**base, "choices": [{"index": c.index, "delta": message, "logprobs": logprobs,
                                 "finish_reason": finish, "stop_reason": delta.stop_reason}]}


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
