"""`foretell serve`: the engine flags plus the server's, and a uvicorn run that shuts down cleanly.

FastAPI and uvicorn are imported only when the command runs, so the rest of the CLI works
without the `server` extra. On SIGTERM (or Ctrl+C) the server stops accepting connections,
aborts what is in flight (streams end with finish_reason "abort", their KV blocks are freed),
stops the engine thread and exits 0. The model loads in the engine thread while the server
already listens: /health answers 503 until it is ready. --switch-interval-ms sets the process's
thread switch interval (the server owns its process).
"""

from __future__ import annotations

import argparse
import os
import sys

from foretell.cli_args import add_engine_args, engine_kwargs_from_args
from foretell.server.tool_parsers import TOOL_CALL_PARSERS

API_KEY_ENV = "FORETELL_API_KEY"
# Python's default (5 ms) is how long the event loop may wait for the interpreter lock while the
# engine thread runs a step, at every hand-over (a new request, a streamed chunk); a few such
# waits would explain a lone request's TTFT of many steps on the H200 (docs/perf-log.md, "TTFT
# under a burst").
DEFAULT_SWITCH_INTERVAL_MS = 0.5


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_args(p, model_required=False)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: %(default)s; 0.0.0.0: all interfaces)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    g.add_argument("--served-model-name",
                   help="the name clients pass as `model` (default: the model folder; with the "
                        "default family qwen3-target or deepseek-target)")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV})")
    g.add_argument("--max-queued-requests", type=int,
                   help="answer 503 (Retry-After) while more requests than this wait for their "
                        "first token (default: no limit)")
    g.add_argument("--max-request-bytes", type=int, default=32 * 2**20,
                   help="answer 413 to request bodies larger than this")
    g.add_argument("--log-stats-interval-s", type=float, default=10.0,
                   help="seconds between engine stats log lines while busy (0: never)")
    g.add_argument("--timeout-graceful-shutdown", type=float, default=10.0,
                   help="seconds to wait for open responses on shutdown before cancelling them")
    g.add_argument("--switch-interval-ms", type=float, default=DEFAULT_SWITCH_INTERVAL_MS,
                   help="Python's thread switch interval in this server process (sys."
                        "setswitchinterval), default %(default)s ms (Python's own: 5): while the "
                        "engine thread runs a step, the event loop (new requests, streamed "
                        "chunks) waits up to this long for the interpreter lock at each hand-over")
    g.add_argument("--tool-call-parser", default="auto", choices=list(TOOL_CALL_PARSERS),
                   help="the format of tool calls on /v1/chat/completions (parsed from the output, "
                        "forced by a grammar for tool_choice required or named): hermes (Qwen3), "
                        "llama3_json (Llama-3.1), deepseek_v3; auto (default): the chat template's")
    g.add_argument("--no-ui", dest="ui", action="store_false",
                   help="do not serve the playground page at / (it shows each token's origin under "
                        "speculation, acceptance charts and a with/without-speculation comparison)")
    g.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="do not log every HTTP request")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log level (default: %(default)s)")
    p.set_defaults(func=run_serve)


def check_server_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if not 0 < args.switch_interval_ms <= 1000:
        raise ValueError(f"--switch-interval-ms must be in (0, 1000] milliseconds, got {args.switch_interval_ms}")


def run_serve(args: argparse.Namespace) -> int:
    from foretell.config import build_engine_config
    from foretell.server.api import build_app
    from foretell.server.async_engine import AsyncEngine
    from foretell.server.launcher import engine_factory_that_logs, serve_forever

    from foretell.defaults import fill_default_models

    fill_default_models(args)
    check_server_args(args)
    kwargs = engine_kwargs_from_args(args)
    config = build_engine_config(args.model, log_stats_interval_s=args.log_stats_interval_s, **kwargs)
    served_name = args.served_model_name or args.model
    async_engine = AsyncEngine(config, engine_factory=engine_factory_that_logs(config, served_name))
    app = build_app(async_engine, served_name, args.api_key or None,
                    args.max_queued_requests, args.max_request_bytes, ui=args.ui,
                    tool_call_parser=args.tool_call_parser)
    # The server owns its process: the engine thread and the event loop share one interpreter
    # lock, and a hand-over from a busy engine thread waits for the switch interval.
    sys.setswitchinterval(args.switch_interval_ms / 1000.0)
    return serve_forever(
        app, async_engine, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        access_log=args.access_log, timeout_graceful_shutdown=args.timeout_graceful_shutdown,
    )
