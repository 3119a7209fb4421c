"""The FastAPI app: routes, API-key check, and OpenAI-style errors for everything that goes wrong.

build_app(async_engine, served_model_name, api_key, max_queued_requests, max_request_bytes, ui)
returns an app whose lifespan starts the engine thread and stops it (aborting what is in
flight). Every error a client can cause is answered with `{"error": {"message", "type", "param",
"code"}}` and a 4xx status: malformed JSON and schema violations are 400 (not FastAPI's 422, as
OpenAI answers), unknown models and paths 404, a missing or wrong bearer token 401, a body over
the size limit 413, overload and shutdown 503. With `ui` (the default) `GET /` is the playground
page (server/ui_routes.py); `GET /stats` is the engine's stats in JSON.
"""

from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from foretell.server.async_engine import AsyncEngine
from foretell.server.metrics import ServerMetrics
from foretell.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
)
from foretell.server.serving import ServingContext
from foretell.server.serving_chat import create_chat_completion
from foretell.server.serving_completion import create_completion
from foretell.server.ui_routes import add_stats_route, add_ui_routes

logger = logging.getLogger("foretell.server")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable"}
# What the OpenAPI document promises, kept to what the handlers below really answer.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 500, 503)
}
# With `stream: true`, Server-Sent Events; before OpenAPI 3.2 a stream's schema is that of one
# event, and each event's data is one JSON chunk, the last one `[DONE]`.
STREAM_RESPONSE: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE] last"}},
}}}}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


# What a field accepts, for errors where pydantic tried every member of a union.
FIELD_HINTS = {
    "prompt": "expected a non-empty string, a list of strings, a list of token ids, or a list of "
              "lists of token ids",
    "stop": "expected a string or a list of strings",
    "messages": "expected a non-empty list of messages, each with a role (system, developer, "
                "user, assistant, tool) and content (a string or a list of text parts)",
}


def describe_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A readable message and the offending parameter from pydantic's error list."""
    for e in errors:
        if e.get("type") == "json_invalid":
            detail = e.get("ctx", {}).get("error", "")
            return f"the request body is not valid JSON: {detail}".rstrip(": "), None
    by_field: dict[str, list[dict[str, Any]]] = {}
    for e in errors:
        loc = [x for x in e.get("loc", ()) if x != "body"]
        by_field.setdefault(str(loc[0]) if loc else "body", []).append(e)
    parts = []
    for name, errs in by_field.items():
        if name in FIELD_HINTS and len(errs) > 1:
            parts.append(f"{name}: {FIELD_HINTS[name]} (got {_short(errs[0].get('input'))})")
            continue
        e = errs[0]
        path = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        shown = "" if e.get("type") == "missing" else f" (got {_short(e.get('input'))})"
        parts.append(f"{path}: {e.get('msg', 'invalid value')}{shown}")
    first = next(iter(by_field))
    return "; ".join(parts), (None if first == "body" else first)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class APIKeyMiddleware:
    """401 for /v1/* requests without `Authorization: Bearer <key>`. /health, /metrics stay open."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                error = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                 "authentication_error", code="invalid_api_key")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for request bodies over the limit, before they are buffered whole: a declared
    Content-Length is checked up front, a chunked body as it arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = APIError(413, f"the request body is larger than {self.max_bytes} bytes",
                             code="request_too_large")
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(too_large)(scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise too_large
            return message

        await self.app(scope, limited_receive, send)


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_queued_requests: int | None = None,
    max_request_bytes: int = 32 * 2**20,
    ui: bool = True,
    tool_call_parser: str = "auto",
) -> FastAPI:
    metrics = ServerMetrics(async_engine.stats, served_model_name)
    async_engine.on_request_finished = metrics.observe_finished
    ctx = ServingContext(async_engine, served_model_name, max_queued_requests, tool_call_parser=tool_call_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        await async_engine.stop()
        ctx.close()

    app = FastAPI(title="foretell", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_bytes)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(list(exc.errors()))
        return error_response(APIError(400, message, param=param, code="invalid_request"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, APIError):  # raised while FastAPI read the body (too large)
            return error_response(exc.__cause__)
        error_type = ERROR_TYPES.get(exc.status_code, "invalid_request_error")
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}: see /docs for the API"
        return error_response(APIError(exc.status_code, message, error_type, headers=exc.headers))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}",
                                       "internal_server_error"))

    @app.get("/health", response_model=HealthResponse, responses={503: {"model": ErrorResponse}})
    async def health():
        """200 `{"status": "ok"}` once the model is loaded and the KV cache allocated, 503 before
        (or when dying)."""
        if async_engine.is_ready and async_engine.is_alive and not async_engine.draining:
            return JSONResponse({"status": "ok"})
        reason = async_engine.not_ready_reason()
        return error_response(APIError(503, reason, "service_unavailable", code="not_ready"))

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition format."""
        await async_engine.fresh_stats()  # the collector reads this snapshot
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models", response_model=ModelList, responses={401: {"model": ErrorResponse}})
    async def list_models() -> ModelList:
        card = ModelCard(id=served_model_name, root=async_engine.config.model.model,
                         max_model_len=async_engine.max_model_len)
        return ModelList(data=[card])

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**ERROR_RESPONSES, **STREAM_RESPONSE})
    async def completions(body: CompletionRequest, raw_request: Request):
        """OpenAI completions; `stream: true` answers with Server-Sent Events."""
        return await create_completion(body, ctx, raw_request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**ERROR_RESPONSES, **STREAM_RESPONSE})
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request):
        """OpenAI chat completions through the tokenizer's chat template."""
        return await create_chat_completion(body, ctx, raw_request)

    add_stats_route(app, async_engine, served_model_name)
    if ui:
        add_ui_routes(app)
    app.openapi = lambda: openapi_without_422(app)
    return app


def openapi_without_422(app: FastAPI) -> dict[str, Any]:
    """FastAPI documents a 422 for every route with a body, but schema violations are answered
    400 here (as OpenAI does): drop the 422s and their schemas so the document tells the truth."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                             description=app.description, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        schemas = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
