"""The embedded default (SmolLM2-135M-Instruct, bundled GGUF) answers a real question."""

import asyncio

import httpx
import pytest

from ddserve.api.app import create_app
from ddserve.backends.local import LocalBackend
from ddserve.config.engine import EngineConfig
from ddserve.engine.runner import EngineRunner


@pytest.mark.slow
def test_default_model_answers():
    runner = EngineRunner(EngineConfig())
    runner.start()
    try:

        async def go():
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=create_app(LocalBackend(runner))),
                base_url="http://t",
                timeout=120,
            ) as c:
                return (
                    await c.post(
                        "/v1/chat/completions",
                        json={
                            "model": "smollm2-135m",
                            "messages": [
                                {"role": "user", "content": "What is the capital of France?"}
                            ],
                            "max_tokens": 20,
                        },
                    )
                ).json()

        r = asyncio.run(go())
    finally:
        runner.shutdown()
    assert "Paris" in r["choices"][0]["message"]["content"]
    assert r["ddtree"]["verify_rounds"] >= 1
