"""`foretell bench serve`: a load generator for any OpenAI-compatible server (foretell's, vLLM's,
SGLang's, ...).

Requests stream (SSE) from /v1/completions or /v1/chat/completions, sent as a Poisson process at
--request-rate (or all at once), at most --max-concurrency in flight. Per request: time to first
token (TTFT), time per output token after the first (TPOT), the gaps between streamed chunks
(inter-token latency, ITL; with speculative decoding one chunk may carry several tokens), and the
end-to-end latency. Token counts come from the server's usage block when it sends one
(stream_options.include_usage), else from the number of non-empty chunks. When the server
exposes Prometheus counters `<prefix>:spec_decode_*` at /metrics (foretell and vLLM do), the
acceptance of the run is read from their change over the run.

Latency under load (`--concurrency 1,16,64`): one closed-loop run per level (that many requests
in flight, a new one sent as one ends), each with prompts of its own (later levels must not
find earlier levels' prompts in the prefix cache) and of distinct lengths (so that a server that
compiles kernels per shape shows it); a table of TTFT, TPOT and ITL percentiles per level.

Per request (`--per-request-json PATH`): when each request was sent (ms after the run's start),
its TTFT, latency and token counts, in the order sent, so a burst's first wave (the first
`concurrency` requests of a closed loop, sent together) can be told from later arrivals (each
sent alone into a running batch); the table then adds the first wave's and the later requests'
mean TTFT.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field, replace
from typing import Any

from foretell.bench.datasets import Prompt
from foretell.bench.serve_summary import RequestResult, per_request_rows, summarize_results, wave_ttft
from foretell.bench.spec_metrics_scrape import parse_spec_metrics, spec_delta


@dataclass
class ServeSettings:
    base_url: str
    prompts: list[Prompt]
    model: str | None = None
    api: str = "completions"  # completions | chat
    endpoint: str | None = None  # default: /v1/completions or /v1/chat/completions
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 600.0
    metrics_url: str | None = None  # default: base_url + /metrics; "" to skip
    percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    progress: bool = True
    per_request: bool = False  # keep one row per request in the report ("requests")




def build_payload(s: ServeSettings, model: str, prompt: Prompt) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if s.ignore_eos:
        payload["ignore_eos"] = True  # a vLLM / foretell extension of the OpenAI schema
    if s.api == "chat":
        if prompt.text is None:
            raise ValueError(
                f"prompt {prompt.source} is token ids; the chat API needs text "
                f"(use --api completions)"
            )
        payload["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        payload["prompt"] = prompt.text if prompt.text is not None else prompt.token_ids
    return payload


async def send_request(client, url: str, payload: dict[str, Any], chat: bool) -> RequestResult:
    import httpx

    start = time.perf_counter()
    chunk_times: list[float] = []
    usage = None
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")[:300]
                return RequestResult(False, error=f"HTTP {response.status_code}: {body}")
            async for line in response.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    return RequestResult(False, error=f"server error: {chunk['error']}")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    if chat:
                        piece = (choice.get("delta") or {}).get("content")
                    else:
                        piece = choice.get("text")
                    if piece:
                        chunk_times.append(time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    result = RequestResult(True, latency_s=end - start)
    if chunk_times:
        result.ttft_s = chunk_times[0] - start
        result.itl_s = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    if usage and usage.get("completion_tokens") is not None:
        result.output_tokens = int(usage["completion_tokens"])
        result.prompt_tokens = usage.get("prompt_tokens")
        result.counted_from_usage = True
    else:
        result.output_tokens = len(chunk_times)
    return result


async def _fetch_metrics(client, url: str | None) -> dict | None:
    import httpx

    if not url:
        return None
    try:
        response = await client.get(url)
    except httpx.HTTPError:
        return None
    return parse_spec_metrics(response.text) if response.status_code == 200 else None


async def _resolve_model(client, s: ServeSettings) -> str:
    import httpx

    url = s.base_url.rstrip("/") + "/v1/models"
    try:
        response = await client.get(url)
    except httpx.HTTPError as e:
        raise ValueError(f"could not reach the server at {s.base_url} ({e}); is it running?") from e
    if s.model:
        return s.model
    try:
        return response.json()["data"][0]["id"]
    except Exception:
        raise ValueError(
            f"could not read a model name from {url} (HTTP {response.status_code}); pass --model"
        ) from None


async def run_serve_load(s: ServeSettings) -> dict[str, Any]:
    import httpx
    from tqdm import tqdm

    if not s.prompts:
        raise ValueError("no prompts to send")
    if s.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {s.request_rate}")
    if s.max_concurrency is not None and s.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {s.max_concurrency}")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per request
    chat = s.api == "chat"
    path = s.endpoint or ("/v1/chat/completions" if chat else "/v1/completions")
    url = s.base_url.rstrip("/") + path
    metrics_url = s.base_url.rstrip("/") + "/metrics" if s.metrics_url is None else s.metrics_url
    limit = s.max_concurrency or len(s.prompts)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(s.timeout_s), limits=limits) as client:
        model = await _resolve_model(client, s)
        payloads = [build_payload(s, model, p) for p in s.prompts]
        metrics_before = await _fetch_metrics(client, metrics_url)
        gate = asyncio.Semaphore(limit)
        rng = random.Random(s.seed)
        bar = tqdm(total=len(payloads), desc="bench serve", unit="req", disable=not s.progress)

        async def one(payload):
            async with gate:
                sent = time.perf_counter()
                result = await send_request(client, url, payload, chat)
            result.sent_s = sent - start
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for i, payload in enumerate(payloads):
            if i and math.isfinite(s.request_rate):
                await asyncio.sleep(rng.expovariate(s.request_rate))
            tasks.append(asyncio.create_task(one(payload)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
        metrics_after = await _fetch_metrics(client, metrics_url)
    report = summarize_results(results, duration, s.percentiles)
    if s.per_request:
        report["requests"] = per_request_rows(results)
    report.update(
        base_url=s.base_url, endpoint=path, model=model, num_prompts=len(payloads),
        max_tokens=s.max_tokens, temperature=s.temperature, ignore_eos=s.ignore_eos,
        request_rate=s.request_rate if math.isfinite(s.request_rate) else "inf",
        max_concurrency=s.max_concurrency, metrics_url=metrics_url or None,
        spec_decode=spec_delta(metrics_before, metrics_after),
    )
    return report


# ---- latency under load -----------------------------------------------------------------------


def prompt_length(prompt: Prompt) -> int:
    """Characters of a text prompt, tokens of a token-id prompt."""
    return len(prompt.text) if prompt.text is not None else len(prompt.token_ids or [])


def prompts_of_distinct_lengths(prompts: list[Prompt], seed: int) -> list[Prompt]:
    """One prompt of each length (characters, or tokens for token-id prompts), in a seeded
    random order."""
    by_length: dict[int, Prompt] = {}
    for prompt in prompts:
        by_length.setdefault(prompt_length(prompt), prompt)
    distinct = list(by_length.values())
    random.Random(seed).shuffle(distinct)
    return distinct


def parse_concurrencies(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or any(c < 1 for c in levels):
        raise ValueError(f"--concurrency must be comma-separated integers >= 1, e.g. 1,16,64; got {text!r}")
    return levels


async def run_concurrency_sweep(
    s: ServeSettings, concurrencies: list[int], requests_per_level: int, distinct_lengths: bool = True
) -> dict[str, Any]:
    """run_serve_load at each concurrency (closed loop: all requests queued, `c` in flight),
    with requests_per_level prompts per level, of distinct lengths (unless distinct_lengths is
    False: random prompts all have --input-len tokens), none shared between levels while the
    prompts last (then they are reused, in order)."""
    if requests_per_level < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {requests_per_level}")
    if distinct_lengths:
        pool = prompts_of_distinct_lengths(s.prompts, s.seed)
    else:
        pool = list(s.prompts)
        random.Random(s.seed).shuffle(pool)
    if not pool:
        raise ValueError("no prompts to send")
    levels = []
    for i, concurrency in enumerate(concurrencies):
        start = i * requests_per_level
        prompts = [pool[(start + j) % len(pool)] for j in range(requests_per_level)]
        report = await run_serve_load(replace(s, prompts=prompts, max_concurrency=concurrency,
                                              request_rate=math.inf))
        level = {"concurrency": concurrency,
                 "prompt_lengths": sorted(prompt_length(p) for p in prompts), **report}
        if "requests" in report:
            level["ttft_by_wave_ms"] = wave_ttft(report["requests"], concurrency)
        levels.append(level)
    return {
        "mode": "concurrency_sweep", "base_url": s.base_url, "model": levels[0]["model"],
        "concurrencies": concurrencies, "requests_per_level": requests_per_level,
        "distinct_prompt_lengths": len({prompt_length(p) for p in pool}),
        "prompts_reused": requests_per_level * len(concurrencies) > len(pool),
        "percentiles": s.percentiles, "levels": levels,
    }
