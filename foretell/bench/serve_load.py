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
import re
import time
from dataclasses import dataclass, field, replace
from typing import Any

from foretell.bench.datasets import Prompt
from foretell.bench.report import acceptance_counters

SPEC_METRIC = re.compile(
    r"^(?:[A-Za-z_][A-Za-z0-9_]*:)?spec_decode_"
    r"(num_drafts|num_draft_tokens|num_accepted_tokens_per_pos|num_accepted_tokens)(?:_total)?$"
)
LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


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


@dataclass
class RequestResult:
    ok: bool
    latency_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    counted_from_usage: bool = False
    error: str | None = None
    sent_s: float = 0.0  # when the request was sent, seconds after the run's start


# ---- Prometheus text --------------------------------------------------------------------------


def parse_spec_metrics(text: str) -> dict[str, Any] | None:
    """The spec_decode counters in a Prometheus exposition (summed over labels other than
    position), or None when there are none."""
    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, labels, value = _split_sample(line)
        if name is None:
            continue
        m = SPEC_METRIC.match(name)
        if not m:
            continue
        kind = m.group(1)
        if kind == "num_accepted_tokens_per_pos":
            try:
                pos = int(labels.get("position", ""))
            except ValueError:
                continue
            per_position[pos] = per_position.get(pos, 0.0) + value
        else:
            totals[kind] = totals.get(kind, 0.0) + value
    if not totals and not per_position:
        return None
    return {"totals": totals, "per_position": per_position}


def _split_sample(line: str) -> tuple[str | None, dict[str, str], float]:
    if "{" in line:
        name, rest = line.split("{", 1)
        label_text, _, rest = rest.rpartition("}")
        labels = dict(LABEL.findall(label_text))
    else:
        name, _, rest = line.partition(" ")
        labels = {}
    fields_ = rest.split()
    try:
        return name.strip(), labels, float(fields_[0])
    except (IndexError, ValueError):
        return None, {}, 0.0


def spec_delta(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    if after is None:
        return None
    before = before or {"totals": {}, "per_position": {}}
    def d(kind):
        return after["totals"].get(kind, 0.0) - before["totals"].get(kind, 0.0)
    drafts, draft_tokens = d("num_drafts"), d("num_draft_tokens")
    accepted = d("num_accepted_tokens")
    positions = sorted(after["per_position"])
    per_pos = [after["per_position"][p] - before["per_position"].get(p, 0.0) for p in positions]
    return acceptance_counters(drafts, draft_tokens, accepted, per_pos)


# ---- requests ---------------------------------------------------------------------------------


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


def format_sweep_report(report: dict[str, Any]) -> str:
    from foretell.bench.report import fmt, table

    first = report["levels"][0]
    keys = [f"p{p:g}" for p in report["percentiles"]]
    headers = ["concurrency", "ok", "failed", "req/s", "out tok/s"]
    for label in ("TTFT", "TPOT", "ITL"):
        headers += [f"{label} {k}" for k in keys]
    rows = []
    for level in report["levels"]:
        row = [str(level["concurrency"]), str(level["completed"]), str(level["failed"]),
               fmt(level["request_throughput"]), fmt(level["output_throughput"], ".1f")]
        for field_ in ("ttft_ms", "tpot_ms", "itl_ms"):
            row += [fmt(level[field_][k]) for k in keys]
        rows.append(row)
    reuse = " (too few prompts: some are reused)" if report["prompts_reused"] else ""
    lines = [
        f"foretell bench serve: {report['base_url']}{first['endpoint']} model {report['model']}",
        f"latency under load: {report['requests_per_level']} requests per level, prompts of "
        f"{report['distinct_prompt_lengths']} distinct lengths{reuse}, max_tokens "
        f"{first['max_tokens']}; times in ms",
        "",
        table(headers, rows),
    ]
    waves = [level for level in report["levels"] if "ttft_by_wave_ms" in level]
    if waves:
        lines += ["", "mean TTFT (ms), first wave (the first `concurrency` requests, sent "
                  "together) / later requests (each sent alone into a running batch):"]
        for level in waves:
            wave = level["ttft_by_wave_ms"]
            lines.append(f"  concurrency {level['concurrency']}: {fmt(wave['first_wave'])} / "
                         f"{fmt(wave['later'])}")
    for level in report["levels"]:
        for error in level["errors"]:
            lines.append(f"error (concurrency {level['concurrency']}): {error}")
    return "\n".join(lines)


# ---- summary ----------------------------------------------------------------------------------


def per_request_rows(results: list[RequestResult]) -> list[dict[str, Any]]:
    """One row per request, in the order sent: send time, TTFT and latency in ms, tokens."""
    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * 1000.0

    return [
        {"index": i, "sent_ms": ms(r.sent_s), "ok": r.ok, "ttft_ms": ms(r.ttft_s),
         "latency_ms": ms(r.latency_s) if r.ok else None, "prompt_tokens": r.prompt_tokens,
         "output_tokens": r.output_tokens, "error": r.error}
        for i, r in enumerate(results)
    ]


def per_request_tables(report: dict[str, Any]) -> dict[str, Any]:
    """What --per-request-json writes: the per-request rows of a run, or of each level of a
    sweep (with the level's first-wave and later mean TTFT)."""
    if report.get("mode") == "concurrency_sweep":
        return {"mode": "concurrency_sweep", "base_url": report["base_url"], "levels": [
            {"concurrency": level["concurrency"], "ttft_by_wave_ms": level.get("ttft_by_wave_ms"),
             "requests": level.get("requests", [])}
            for level in report["levels"]]}
    return {"base_url": report["base_url"], "max_concurrency": report["max_concurrency"],
            "requests": report.get("requests", [])}


def wave_ttft(rows: list[dict[str, Any]], concurrency: int) -> dict[str, float | None]:
    """Mean TTFT (ms) of a closed loop's first wave (the first `concurrency` requests, sent
    together) and of the later requests (each sent as another one ended)."""
    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    ttfts = [(row["index"], row["ttft_ms"]) for row in rows if row["ttft_ms"] is not None]
    return {"first_wave": mean([t for i, t in ttfts if i < concurrency]),
            "later": mean([t for i, t in ttfts if i >= concurrency])}


def distribution(values_s: list[float], percentiles: list[float]) -> dict[str, float | None]:
    """Mean, standard deviation and percentiles in ms (p50 is the median)."""
    import numpy as np

    if not values_s:
        return {"mean": None, "std": None, **{f"p{p:g}": None for p in percentiles}}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {"mean": float(ms.mean()), "std": float(ms.std())}
    out.update({f"p{p:g}": float(np.percentile(ms, p)) for p in percentiles})
    return out


def summarize_results(
    results: list[RequestResult], duration_s: float, percentiles: list[float]
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_counts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    prompt_tokens = sum(prompt_counts) if ok and len(prompt_counts) == len(ok) else None
    tpot = [
        (r.latency_s - r.ttft_s) / (r.output_tokens - 1)
        for r in ok if r.ttft_s is not None and r.output_tokens > 1
    ]
    sources = {r.counted_from_usage for r in ok}
    errors = [r.error for r in results if not r.ok]
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(errors),
        "errors": errors[:5],
        "duration_s": duration_s,
        "total_output_tokens": output_tokens,
        "total_prompt_tokens": prompt_tokens,
        "token_count_source": (
            "usage" if sources == {True} else "chunks" if sources == {False} else "mixed"
        ) if ok else None,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else None,
        "total_token_throughput": (
            (output_tokens + prompt_tokens) / duration_s
            if prompt_tokens is not None and duration_s > 0 else None
        ),
        "ttft_ms": distribution([r.ttft_s for r in ok if r.ttft_s is not None], percentiles),
        "tpot_ms": distribution(tpot, percentiles),
        "itl_ms": distribution([x for r in ok for x in r.itl_s], percentiles),
        "e2el_ms": distribution([r.latency_s for r in ok], percentiles),
    }


def format_serve_report(report: dict[str, Any]) -> str:
    from foretell.bench.report import fmt, per_position, table

    lines = [
        f"foretell bench serve: {report['base_url']}{report['endpoint']} model {report['model']}",
        f"requests: {report['completed']} completed, {report['failed']} failed, in "
        f"{report['duration_s']:.2f} s (rate {report['request_rate']}, max concurrency "
        f"{report['max_concurrency'] or '-'})",
        f"throughput: {fmt(report['request_throughput'])} req/s, "
        f"{fmt(report['output_throughput'], '.1f')} output tok/s, "
        f"{fmt(report['total_token_throughput'], '.1f')} total tok/s "
        f"(tokens counted from {report['token_count_source'] or '-'})",
        "",
    ]
    stats = [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
             ("E2E latency", "e2el_ms")]
    keys = [k for k in report["ttft_ms"] if k != "std"]
    rows = [[label] + [fmt(report[field_][k]) for k in keys] for label, field_ in stats]
    lines.append(table(["ms"] + keys, rows))
    spec = report.get("spec_decode")
    if spec is not None:
        lines += [
            "",
            f"speculative decoding (from /metrics): acceptance rate "
            f"{fmt(spec['acceptance_rate'])}, "
            f"mean acceptance length {fmt(spec['mean_acceptance_length'])}, drafts "
            f"{spec['num_drafts']:.0f}, per position "
            f"{per_position(spec['acceptance_per_position'])}",
        ]
    for error in report["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
