"""What `foretell bench serve` makes of its requests: each request's record (RequestResult), the
run's summary (throughput; TTFT, TPOT, ITL and end-to-end latency percentiles), the per-request
rows and a burst's first-wave TTFT, and the printed tables of a run and of a concurrency sweep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
