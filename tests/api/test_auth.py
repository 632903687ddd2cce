"""The API key (ddserve.api.auth), in-process: /v1/* and /generate need it, probes do not,
and a refusal is a 401 OpenAI error body before the request is read."""

import asyncio

import httpx
import openai
import pytest

from ddserve.api.app import create_app
from ddserve.backends.local import LocalBackend
from ddserve.config.engine import EngineConfig
from ddserve.engine.runner import EngineRunner
from ddserve.engine.weights import load_model

KEY = "k-3f9a"
CHAT = {"model": "tiny-random:1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def app():
    cfg = EngineConfig(model="tiny-random:1", max_context=128)
    runner = EngineRunner(cfg, loaded=load_model(cfg.model))
    runner.start()
    yield create_app(LocalBackend(runner), admin_token="adm", api_key=KEY)
    runner.shutdown()


def call(app, method: str, path: str, headers: dict | None = None, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as c:
            return await c.request(method, path, headers=headers, **kw)

    return asyncio.run(go())


@pytest.mark.parametrize(
    "method,path,kw",
    [
        ("POST", "/v1/chat/completions", {"json": CHAT}),
        ("POST", "/v1/completions", {"json": {"model": "tiny-random:1", "prompt": "a"}}),
        ("GET", "/v1/models", {}),
        ("POST", "/generate", {"json": {"text": "a"}}),
        ("GET", "/v1/no-such-route", {}),  # 401, not 404: nothing is revealed without the key
        ("POST", "/v1/chat/completions", {"content": b"{not json"}),  # 401 before parsing
    ],
)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {KEY}", KEY])
def test_inference_routes_need_the_key(app, method, path, kw, auth):
    r = call(app, method, path, headers={"authorization": auth} if auth else None, **kw)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"


def test_the_right_key_passes_and_probes_need_none(app):
    ok = {"authorization": f"Bearer {KEY}"}
    assert call(app, "POST", "/v1/chat/completions", ok, json=CHAT).status_code == 200
    assert call(app, "POST", "/generate", ok, json={"text": "a"}).status_code == 200
    assert call(app, "GET", "/v1/models", ok).json()["data"][0]["id"] == "tiny-random:1"
    assert call(app, "GET", "/health").status_code == 200
    info = call(app, "GET", "/server_info").json()
    assert info["api_key_required"] is True and KEY not in str(info)
    # the admin endpoint keeps its own token, not the API key
    admin = call(app, "POST", "/admin/params", {"authorization": f"Bearer {KEY}"}, json={})
    assert admin.status_code == 401


def test_the_openai_sdk_authenticates_with_the_key(app):
    async def go(key: str):
        client = openai.AsyncOpenAI(
            api_key=key,
            base_url="http://t/v1",
            max_retries=0,
            http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)),
        )
        return await client.chat.completions.create(**CHAT)

    assert asyncio.run(go(KEY)).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        asyncio.run(go("wrong"))


def test_without_a_key_nothing_is_required():
    cfg = EngineConfig(model="tiny-random:1", max_context=128)
    runner = EngineRunner(cfg, loaded=load_model(cfg.model))
    runner.start()
    try:
        app = create_app(LocalBackend(runner))
        assert call(app, "GET", "/v1/models").status_code == 200
        assert call(app, "GET", "/server_info").json()["api_key_required"] is False
    finally:
        runner.shutdown()
