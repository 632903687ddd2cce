"""In-process (httpx.ASGITransport) checks of health against a broken model."""

import asyncio

import httpx
import pytest
import torch

from ddserve.api.app import create_app
from ddserve.backends.local import LocalBackend
from ddserve.config.engine import EngineConfig
from ddserve.engine.runner import EngineRunner
from ddserve.engine.weights import load_model


@pytest.fixture()
def runner():
    cfg = EngineConfig(model="tiny-random:1", max_context=128)
    r = EngineRunner(cfg, loaded=load_model(cfg.model))
    r.start()
    yield r
    r.shutdown()


def test_health_generates_and_fails_when_weights_break(runner):
    app = create_app(LocalBackend(runner))

    async def go():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as c:
            ok = await c.get("/health")
            with torch.no_grad():
                runner.engine.model.norm.weight.fill_(float("nan"))
            broken = await c.get("/health")
            chat = await c.post(
                "/v1/chat/completions",
                json={
                    "model": "tiny-random:1",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3,
                },
            )
            return ok, broken, chat

    ok, broken, chat = asyncio.run(go())
    assert ok.status_code == 200 and ok.json()["status"] == "ok"
    assert broken.status_code in (500, 503) and "non-finite" in broken.json()["error"]["message"]
    assert chat.status_code == 500 and chat.json()["error"]["type"] == "engine_error"


def test_health_samples_with_the_live_defaults(runner):
    """A default that breaks sampling fails readiness even though greedy requests work."""
    app = create_app(LocalBackend(runner))

    def with_temperature(t: float) -> None:  # model_copy skips validation, as a bad path would
        params = runner.config.params.model_copy(update={"temperature": t})
        runner.config = runner.config.model_copy(update={"params": params})

    async def health() -> httpx.Response:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as c:
            return await c.get("/health")

    with_temperature(0.7)
    assert asyncio.run(health()).status_code == 200
    with_temperature(1e-40)  # logits / T overflows: every sampled request would fail
    assert asyncio.run(health()).status_code in (500, 503)
