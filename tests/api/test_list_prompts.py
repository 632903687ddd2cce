"""A list of prompts on /v1/completions, in-process: every prompt is an engine request of its
own, all of them running at once, and each counts against --max-requests."""

import asyncio

import httpx
import pytest

from ddserve.api.app import create_app
from ddserve.api.limits import ServerLimits
from ddserve.backends.local import LocalBackend
from ddserve.config.engine import EngineConfig
from ddserve.engine.runner import EngineRunner
from ddserve.engine.weights import load_model

MODEL = "tiny-random:1"
PROMPTS = ["a b c", "one two", "x", "def f():"]


class Counting(LocalBackend):
    """Counts the engine requests streaming at the same time."""

    def __init__(self, runner):
        super().__init__(runner)
        self.now = self.peak = 0

    async def stream(self, prompt, sampling):
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            async for d in super().stream(prompt, sampling):
                yield d
        finally:
            self.now -= 1


@pytest.fixture(scope="module")
def runner():
    cfg = EngineConfig(model=MODEL, max_context=128)
    r = EngineRunner(cfg, loaded=load_model(cfg.model))
    r.start()
    yield r
    r.shutdown()


def post_all(app, bodies: list[dict]) -> list[httpx.Response]:
    async def go():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

    return asyncio.run(go())


def body(prompts, **kw) -> dict:
    return {"model": MODEL, "prompt": prompts, "max_tokens": 4, "ignore_eos": True, **kw}


@pytest.mark.parametrize("stream", [False, True])
def test_the_prompts_run_at_once_as_separate_engine_requests(runner, stream):
    backend = Counting(runner)
    [r] = post_all(create_app(backend), [body(PROMPTS, stream=stream)])
    assert r.status_code == 200
    assert backend.peak == len(PROMPTS) and backend.now == 0


def test_each_prompt_counts_against_max_requests(runner):
    app = create_app(LocalBackend(runner), limits=ServerLimits(max_requests=3))
    [too_many] = post_all(app, [body(PROMPTS)])
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"
    assert "at most 3 generations" in too_many.json()["error"]["message"]
    # two requests of two prompts: four generations, one more than the limit
    statuses = sorted(r.status_code for r in post_all(app, [body(PROMPTS[:2])] * 2))
    assert statuses == [200, 429]
    for stream in (False, True):  # every admission is given back
        assert post_all(app, [body(PROMPTS[:3], stream=stream)])[0].status_code == 200
    [a, b] = post_all(app, [body(PROMPTS[:3]), body(PROMPTS[:3])])
    assert sorted((a.status_code, b.status_code)) == [200, 429]


class TaskCancelledError(Exception):
    """What Ray Serve raises in a replica's request whose client disconnected (same name)."""


class Cancelled(LocalBackend):
    async def stream(self, prompt, sampling):
        raise TaskCancelledError("the client left")
        yield  # an async generator


def test_a_request_that_serve_cancelled_is_a_disconnect_not_a_server_error(runner):
    app = create_app(Cancelled(runner))

    async def go():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
            base_url="http://t",
        ) as c:
            await c.post("/v1/completions", json=body(["x"]))
            return (await c.get("/server_info")).json()

    totals = asyncio.run(go())["totals"]
    assert totals["errors"] == 0 and totals["client_disconnects"] == 1
