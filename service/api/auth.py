"""API-key authentication of the inference routes, as vLLM does it.

    /v1/*  and  /generate       need `Authorization: Bearer <key>` when a key is set
    /health, /health_generate, /server_info, /metrics, /admin/*   do not (probes, scrapers;
                               /admin/params has its own admin token)

Pure ASGI middleware, outermost: a request without the key is answered 401 with an OpenAI
error body (ddserve.errors.Unauthorized) before its body is read, validated or admitted.
The key is compared in constant time.
"""

from __future__ import annotations

import hmac
import json

from ddserve.errors import Unauthorized, openai_error_body


def protected(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path == "/generate"


class ApiKeyAuth:
    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not protected(scope["path"]):
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        status, body = openai_error_body(
            Unauthorized(
                "wrong API key (Authorization: Bearer <key>)"
                if given
                else "this server needs an API key: send `Authorization: Bearer <key>`"
            )
        )
        data = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})
