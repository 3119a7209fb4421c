"""Where a request's TTFT goes under a closed-loop burst (issue 32): one process serves the default
family as `foretell serve` does (EAGLE3 unless --method none); a client process keeps
--concurrency requests in flight over GSM8K prompts. Per request, on one clock (perf_counter is
CLOCK_MONOTONIC on Linux, shared by both processes), in ms after the client sent it:

  handler     the HTTP request reached the app (an ASGI middleware)
  add         the handler handed the tokenized prompt to the engine thread
  engine_add  the engine thread added it (between two steps)
  out_step    end of the engine step that produced its first output
  dispatch    the event loop routed that output to its stream
  ttft        the client read its first text

and the engine steps (start, duration, running sequences). A gap out_step -> dispatch is the event
loop waiting for the interpreter lock (or the CPU); sent -> handler, HTTP and the event loop;
engine_add -> out_step, the steps the request waited for and its own.

    python scripts/serve_timeline.py --concurrency 16 --num-prompts 64 --max-tokens 128 \
        [--switch-interval-ms 5] [--method none] [--out timeline.json]

Every wrapper is an instance attribute of this run's engine and AsyncEngine (nothing of the
package's classes or modules is patched).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

now = time.perf_counter


def run_client(url: str, concurrency: int, num_prompts: int, max_tokens: int, seed: int) -> None:
    """The client process: a closed loop; prints one JSON list of {sent, ttft, latency}."""
    import httpx

    from foretell.bench.datasets import load_prompts
    from foretell.bench.serve_load import ServeSettings, build_payload, send_request

    prompts = load_prompts("gsm8k", num_prompts, seed, None, None)
    settings = ServeSettings(base_url=url, prompts=prompts, max_tokens=max_tokens, ignore_eos=True)

    async def main() -> list[dict]:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
            gate = asyncio.Semaphore(concurrency)

            async def one(prompt) -> dict:
                async with gate:
                    sent = now()
                    r = await send_request(client, url + "/v1/completions", build_payload(settings, model, prompt), False)
                return {"sent": sent, "ttft": r.ttft_s, "latency": r.latency_s, "ok": r.ok, "error": r.error}

            return await asyncio.gather(*(one(p) for p in prompts))

    print(json.dumps(asyncio.run(main())))


class Timeline:
    """Server-side timestamps, keyed by engine request id."""

    def __init__(self):
        self.events: dict[str, dict[str, float]] = {}
        self.steps: list[tuple[float, float, int]] = []
        self.http_start: contextvars.ContextVar[float | None] = contextvars.ContextVar("http_start", default=None)

    def mark(self, request_id: str, name: str, t: float) -> None:
        self.events.setdefault(request_id, {}).setdefault(name, t)

    def middleware(self, app):
        async def timed(scope, receive, send):
            if scope["type"] == "http":
                self.http_start.set(now())
            await app(scope, receive, send)
        return timed

    def instrument_engine(self, engine) -> None:
        add_request, step = engine.add_request, engine.step

        def timed_add(request_id, prompt, params):
            self.mark(request_id, "engine_add", now())
            return add_request(request_id, prompt, params)

        def timed_step():
            start = now()
            outputs = step()
            end = now()
            self.steps.append((start, end - start, len(engine.scheduler.running)))
            for out in outputs:
                self.mark(out.request_id, "out_step", end)
            return outputs

        engine.add_request, engine.step = timed_add, timed_step

    def instrument_async_engine(self, async_engine) -> None:
        add, dispatch = async_engine.add, async_engine._dispatch

        async def timed_add(prompts):
            t, http = now(), self.http_start.get()
            for p in prompts:
                self.mark(p.request_id, "add", t)
                if http is not None:
                    self.mark(p.request_id, "handler", http)
            return await add(prompts)

        def timed_dispatch(items):
            t = now()
            for request_id, _ in items:
                self.mark(request_id, "dispatch", t)
            dispatch(items)

        async_engine.add, async_engine._dispatch = timed_add, timed_dispatch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--method", default="eagle3", help="eagle3 | none (plain decoding)")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="sys.setswitchinterval for the server (default: foretell serve's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the timeline JSON here")
    p.add_argument("--client", help=argparse.SUPPRESS)  # the client process: the server's URL
    args = p.parse_args()
    if args.client:
        run_client(args.client, args.concurrency, args.num_prompts, args.max_tokens, args.seed)
        return

    from foretell.config import build_engine_config
    from foretell.defaults import default_target, member_path
    from foretell.engine.engine import Engine
    from foretell.server.api import build_app
    from foretell.server.async_engine import AsyncEngine
    from foretell.server.cli import DEFAULT_SWITCH_INTERVAL_MS
    from foretell.server.launcher import BackgroundServer

    sys.setswitchinterval((args.switch_interval_ms or DEFAULT_SWITCH_INTERVAL_MS) / 1000.0)
    timeline = Timeline()
    spec = None
    if args.method != "none":
        spec = {"method": args.method, "model": member_path(args.method), "num_speculative_tokens": 3}
    config = build_engine_config(default_target(), speculative_config=spec, log_stats_interval_s=0.0)

    def build() -> Engine:
        engine = Engine(config)
        timeline.instrument_engine(engine)
        return engine

    async_engine = AsyncEngine(config, engine_factory=build)
    timeline.instrument_async_engine(async_engine)
    app = build_app(async_engine, "default", ui=False)
    server = BackgroundServer(timeline.middleware(app), async_engine).start()
    try:
        if not async_engine.wait_ready(timeout=600):
            raise RuntimeError(f"the engine did not load: {async_engine.load_error}")
        client = [sys.executable, os.path.abspath(__file__), "--client", server.url,
                  "--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens)]
        subprocess.run(client + ["--num-prompts", "4", "--seed", "99"], check=True, capture_output=True)
        timeline.events.clear()
        timeline.steps.clear()
        done = subprocess.run(client + ["--num-prompts", str(args.num_prompts), "--seed", str(args.seed)],
                              check=True, capture_output=True, text=True)
    finally:
        server.stop()
    report(json.loads(done.stdout.strip().splitlines()[-1]), timeline, args)


def report(client_rows: list[dict], timeline: Timeline, args) -> None:
    # The server's events in order of arrival, matched with the client's requests in order sent.
    server_rows = sorted(timeline.events.values(), key=lambda e: e.get("handler", e.get("add", 0.0)))
    rows = sorted(client_rows, key=lambda r: r["sent"])
    t0 = rows[0]["sent"]
    names = ["handler", "add", "engine_add", "out_step", "dispatch"]
    table = []
    print(f"{'sent':>8} " + " ".join(f"{n:>10}" for n in names) + f" {'ttft':>8}   (ms after the send)")
    for i, (client, server) in enumerate(zip(rows, server_rows)):
        entry = {"index": i, "sent_ms": 1e3 * (client["sent"] - t0),
                 **{n: 1e3 * (server[n] - client["sent"]) if n in server else None for n in names},
                 "ttft": 1e3 * client["ttft"] if client["ttft"] is not None else None}
        table.append(entry)
        print(f"{entry['sent_ms']:8.1f} " + " ".join(f"{entry[n]:10.1f}" if entry[n] is not None else f"{'-':>10}"
                                                     for n in names + ["ttft"]))
    steps = [{"start_ms": 1e3 * (s - t0), "duration_ms": 1e3 * d, "running": n} for s, d, n in timeline.steps]
    print("\nfirst 40 steps: start ms, duration ms, running")
    for s in steps[:40]:
        print(f"{s['start_ms']:9.1f} {s['duration_ms']:8.2f} {s['running']:4d}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "requests": table, "steps": steps}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
