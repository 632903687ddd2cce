"""The operations endpoints of an app: GET /health (a real generation), /metrics (when the
app meters its own backend), /server_info, and POST /admin/params (live parameters)."""

from __future__ import annotations

import time

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from ddserve.api.http_errors import ERRORS, error_response
from ddserve.api.prometheus import PrometheusExporter
from ddserve.api.protocol import AdminParams
from ddserve.api.served import Served
from ddserve.errors import (
    ConfigError,
    Conflict,
    DDServeError,
    EngineUnavailable,
    InvalidRequest,
    Unauthorized,
)


def register(
    app: FastAPI,
    s: Served,
    *,
    exporter: PrometheusExporter | None,
    admin_token: str | None,
    admin_enabled: bool,
    api_key: str | None,
) -> None:
    """The operations routes on `app`, over `s`; /metrics only with an `exporter`."""

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        try:
            latency = await s.backend.check_health()
        except DDServeError as exc:
            return error_response(exc if exc.status_code >= 500 else EngineUnavailable(exc.message))
        return {
            "status": "ok",
            "system_fingerprint": s.backend.fingerprint,
            "latency_ms": round(latency * 1e3, 2),
        }

    if exporter is not None:

        @app.get("/metrics", include_in_schema=False)
        async def metrics():
            s.backend.refresh_gauges()
            body, content_type = exporter.render()
            return Response(body, media_type=content_type)

    @app.get("/server_info")
    async def server_info():
        return {
            **s.backend.info(),
            "totals": dict(s.totals),
            "uptime_s": round(time.time() - s.started_at, 1),
            "admin_protected": admin_token is not None,
            "api_key_required": api_key is not None,
            "in_flight": s.admission.active,
            "api_server": s.api_server,  # the API process that answered (totals are its own)
        }

    def admin_guard(request: Request) -> None:
        if not admin_enabled:
            raise Conflict(
                "this is one replica of many: change parameters with `ddserve reconfig set`, which rolls them out to every replica and verifies each"
            )
        if (
            admin_token is not None
            and request.headers.get("authorization") != f"Bearer {admin_token}"
        ):
            raise Unauthorized(
                "changing live parameters needs the admin token (Authorization: Bearer ...)"
            )

    @app.post("/admin/params", dependencies=[Depends(admin_guard)], responses=ERRORS)
    async def admin_params(body: AdminParams):
        changes = body.model_dump(exclude_unset=True)
        if not changes:
            raise InvalidRequest(
                'send a JSON object of live parameters to change, e.g. {"budget": 16}'
            )
        try:
            result = await s.backend.update_params(changes)
        except ConfigError as exc:
            raise InvalidRequest(exc.message, param=exc.param) from exc
        return result
