"""In-process (httpx.ASGITransport) checks of health against a broken model."""

import asyncio

import httpx
import pytest
import torch

from ddserve.api.app import create_app
from ddserve.backends.local import LocalBackend
from ddserve.config.engine import EngineConfig
from ddserve.engine import sampling
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


def test_health_samples_with_the_live_defaults(runner, monkeypatch):
    """Readiness generates with the live defaults: a default whose sampling fails (here a
    sampler that breaks at temperature > 0, standing in for any sampling fault) fails /health
    although greedy requests work."""
    import ddserve.engine as engine_pkg

    real = sampling.sample_rows

    def breaks_when_sampled(logits, groups, inputs=None):
        if any(g.params.temperature > 0 for g in groups):
            raise RuntimeError("sampling broke")
        return real(logits, groups, inputs)

    for mod in vars(engine_pkg).values():  # every engine module that samples
        if getattr(mod, "sample_rows", None) is real:
            monkeypatch.setattr(mod, "sample_rows", breaks_when_sampled)
    app = create_app(LocalBackend(runner))

    def with_temperature(t: float) -> None:
        runner.update_params(temperature=t)

    async def health() -> httpx.Response:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as c:
            return await c.get("/health")

    with_temperature(0.0)
    assert asyncio.run(health()).status_code == 200
    with_temperature(0.7)
    assert asyncio.run(health()).status_code in (500, 503)
