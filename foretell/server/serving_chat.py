"""The chat endpoint (/v1/chat/completions): a validated ChatCompletionRequest into one engine
request, and the engine's final outputs into an OpenAI response (streams: see streaming.py).

The messages are rendered by the chat template on the context's tokenizer thread (serving.py).
With tools, the output is parsed for tool calls (server/tool_calls.py), streamed or not.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from foretell.engine.outputs import CompletionOutput
from foretell.engine.sequence import Logprob
from foretell.server.async_engine import PromptSpec
from foretell.server.protocol import APIError, ChatCompletionRequest, usage
from foretell.server.serving import ServingContext, collect_finals, finite, new_id, sampling_params
from foretell.server.streaming import Delta, sse_response
from foretell.server.tool_calls import ToolCallStream, ToolPlan, chat_message, message_dicts, plan_tools
from foretell.server.tool_calls import render_with_tools


async def chat_prompt(req: ChatCompletionRequest, ctx: ServingContext, tools: list[dict] | None = None) -> list[int]:
    messages = message_dicts(req)
    ctx.check_ready()
    ctx.check_prompt_chars(sum(len(m["content"]) for m in messages), "the messages' content", "messages")
    return await ctx.on_tokenizer_thread(render_chat, ctx.engine.tokenizer, messages, req.add_generation_prompt, tools)


def render_chat(
    tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None
) -> list[int]:
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


def tool_chunk(
    base: dict, c: CompletionOutput, delta: Delta, tools: ToolCallStream, logprobs: dict | None
) -> dict | None:
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

