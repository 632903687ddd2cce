"""The engine server: one builtin engine behind HTTP.

  POST /generate              native (SGLang-style) generation: text or input_ids
  POST /v1/chat/completions   OpenAI chat (stream via SSE, or not)
  POST /v1/completions        OpenAI completions
  GET  /v1/models             the served model
  GET  /health                a real one-token generation (SGLang's /health_generate)
  GET  /server_info           effective config, fingerprint, load, totals
  POST /admin/params          change live parameters; answers once they are in force
  GET  /metrics               Prometheus metrics (ddserve.api.prometheus), when this app
                              meters its own backend (the engine server; not a Ray replica)

Errors: `ddserve.errors.openai_error_body` is the only mapping to HTTP. Before a stream's
first chunk an error is an HTTP status; after it, an `error` event in the stream.

This module builds the app (middlewares, error handlers, metering); the routes live by family
in openai_routes, native_routes and ops_routes, over what they share (ddserve.api.served).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from ddserve.api import native_routes, openai_routes, ops_routes
from ddserve.api.auth import ApiKeyAuth
from ddserve.api.backend import Backend
from ddserve.api.http_errors import error_response, http_error, validation_message
from ddserve.api.limits import BodySizeLimit, ServerLimits
from ddserve.api.observability import (
    AccessLog,
    MeteredBackend,
    StatsLog,
    drafter_depth,
    engine_load,
)
from ddserve.api.prometheus import PrometheusExporter
from ddserve.api.served import Served
from ddserve.errors import DDServeError, InvalidRequest

log = logging.getLogger(__name__)
# what Ray Serve raises in a replica's request when its client disconnected (by name: the API
# also runs without Ray): a cancellation, not a server error (the probe of 2026-12-07 found
# them counted in /server_info's errors and logged with tracebacks)
CANCELLED = frozenset({"TaskCancelledError", "RequestCancelledError", "CancelledError"})


# the routes whose requests `ddserve:requests_total` counts (a refusal there: client_error)
GENERATING = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})


def freeze_startup_heap() -> None:
    """Move everything start-up allocated (the app, the tokenizer, imported modules) out of
    the garbage collector's sight, so collections during a burst of requests walk only the
    requests' own objects (vLLM's and SGLang's API servers do the same)."""
    gc.collect()
    gc.freeze()


def create_app(
    backend: Backend,
    *,
    admin_token: str | None = None,
    title: str = "ddserve engine",
    admin_enabled: bool = True,
    limits: ServerLimits | None = None,
    access_log: bool | None = None,
    stats_interval_s: float | None = None,
    api_key: str | None = None,
    stream_interval: int = 1,
    api_server: tuple[int, int] = (0, 1),
) -> FastAPI:
    """The OpenAI API over any backend (ddserve.api.backend.Backend: the contract), under
    `limits` (ddserve.api.limits: body size, deadline, admission); with `api_key`, /v1/* and
    /generate need it as a Bearer token (ddserve.api.auth); streams send a chunk per
    `stream_interval` tokens after the first (EngineConfig.stream_interval).

    A backend that is not metered yet gets a `MeteredBackend` with a Prometheus exporter,
    served at GET /metrics (the engine server); a `MeteredBackend` passed in keeps its own
    exporter (a Ray replica: Ray's metrics agent exports it). `access_log` (default: env
    DDSERVE_ACCESS_LOG=1) logs one line per HTTP request; a stats line is logged every
    `stats_interval_s` while there is work (default: env DDSERVE_STATS_INTERVAL or 10; 0 = off).
    `api_server`: (this process's index, how many API processes the server runs), said by
    /server_info (ddserve.cli.api_server)."""
    limits = limits or ServerLimits()
    if access_log is None:
        access_log = os.environ.get("DDSERVE_ACCESS_LOG", "").lower() in ("1", "true", "yes", "on")
    if stats_interval_s is None:
        stats_interval_s = float(os.environ.get("DDSERVE_STATS_INTERVAL") or 10.0)
    exporter = None
    if not isinstance(backend, MeteredBackend):
        exporter = PrometheusExporter(backend.model_id)
        backend = MeteredBackend(
            backend,
            exporter,
            drafter_depth=drafter_depth(backend.info().get("config", {}).get("drafter", {})),
            load=engine_load(backend),
            record_reconfig=True,
        )
    stats = StatsLog(backend, stats_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        task = asyncio.create_task(stats.run()) if stats_interval_s > 0 else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()

    app = FastAPI(title=title, docs_url=None, redoc_url=None, lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyAuth, api_key=api_key)  # outside the body limit: 401 first
    if access_log:
        app.add_middleware(AccessLog)  # outermost: sees every answer, 401s and 413s included
    s = Served(backend, limits, stream_interval)
    index, count = api_server
    s.api_server = {"index": index, "count": count, "pid": os.getpid()}  # /server_info says it

    @app.exception_handler(DDServeError)
    async def _ddserve_error(request: Request, exc: DDServeError):
        if exc.status_code >= 500:
            s.totals["errors"] += 1
        elif request.url.path in GENERATING and not exc.counted:
            backend.refused()
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        msg, param = validation_message(exc)
        if request.url.path in GENERATING:
            backend.refused()
        return error_response(InvalidRequest(msg, param=param))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return http_error(request, exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        if type(exc).__name__ in CANCELLED:  # the client left and Serve cancelled its request
            s.totals["client_disconnects"] += 1
            log.info("client of %s left; its request was cancelled", request.url.path)
            return error_response(exc)
        log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        s.totals["errors"] += 1
        return error_response(exc)

    openai_routes.register(app, s)
    native_routes.register(app, s)
    ops_routes.register(
        app,
        s,
        exporter=exporter,
        admin_token=admin_token,
        admin_enabled=admin_enabled,
        api_key=api_key,
    )
    return app
