"""The completions endpoint (/v1/completions): a validated CompletionRequest into engine
requests, and the engine's final outputs into an OpenAI response (streams: see streaming.py).

One API call becomes one engine request per prompt (each with n sequences); choice index
i * n + j is prompt i's j-th sample, as OpenAI numbers them. Prompts are tokenized on the
context's tokenizer thread (serving.py); `echo` with `logprobs` scores the prompt too.
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
from foretell.server.protocol import APIError, CompletionRequest, usage
from foretell.server.serving import ServingContext, collect_finals, finite, new_id, sampling_params
from foretell.server.streaming import Delta, sse_response


async def completion_prompts(
    req: CompletionRequest, ctx: ServingContext, request_id: str
) -> tuple[list[PromptSpec], list[str]]:
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

