"""The playground page and the JSON stats it polls.

`GET /` serves foretell/server/ui/index.html and `/ui/*` its script and style sheet (static files
shipped in the package: no build step, nothing fetched from elsewhere). `foretell serve --no-ui`
leaves both out. `GET /stats` (always there, open like /metrics) is the engine's stats snapshot in
JSON with what the page needs to know about the server: the served model, the drafter and k.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.responses import FileResponse, JSONResponse
from starlette.staticfiles import StaticFiles

from foretell.server.async_engine import AsyncEngine

UI_DIR = Path(__file__).parent / "ui"
# The page loads only its own files and talks only to this server.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
                               "base-uri 'none'; frame-ancestors 'none'",
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}


def server_info(async_engine: AsyncEngine, served_model_name: str) -> dict[str, Any]:
    """What GET /stats answers: the server's model and drafter, and the engine's counters."""
    spec = async_engine.config.speculative
    drafter = None
    if spec is not None:
        drafter = {"method": spec.method, "model": spec.model,
                   "num_speculative_tokens": spec.num_speculative_tokens}
    return {
        "model": served_model_name,
        "ready": async_engine.is_ready,
        "max_model_len": async_engine.max_model_len,
        "speculative": drafter,
        "time": time.time(),
        "stats": dict(async_engine.stats() or {}),
    }


def add_stats_route(app: FastAPI, async_engine: AsyncEngine, served_model_name: str) -> None:
    @app.get("/stats")
    async def stats() -> JSONResponse:
        """The engine's stats (as /metrics, in JSON), the served model and its drafter."""
        await async_engine.fresh_stats()  # server_info reads this snapshot
        return JSONResponse(server_info(async_engine, served_model_name),
                            headers={"Cache-Control": "no-store"})


def add_ui_routes(app: FastAPI) -> None:
    if not (UI_DIR / "index.html").is_file():
        raise FileNotFoundError(f"the playground's files are missing from {UI_DIR}: reinstall "
                                f"foretell, or serve with --no-ui")

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(UI_DIR / "index.html", media_type="text/html", headers=PAGE_HEADERS)

    app.mount("/ui", StaticFiles(directory=UI_DIR), name="ui")
