"""RemoteBackend against a stand-in for SGLang's HTTP server.

SGLang itself cannot run here (no GPU). `fake_sglang` below is a named stand-in that
answers the subset the replica uses, shaped like SGLang 0.5.x responses: streamed
`/generate` with cumulative `text`, `meta_info` with `completion_tokens`, `spec_verify_ct`
and `finish_reason` (no per-round histogram, no fingerprint), `/get_server_info` with
`context_length`, and `/health_generate`."""

import asyncio
import json
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ddserve.backends.remote import RemoteBackend
from ddserve.config.engine import EngineConfig
from ddserve.engine.sampling import SamplingParams
from ddserve.errors import Conflict, InvalidRequest
from tests.api.conftest import free_port

SEEN: list[dict] = []


def fake_sglang() -> FastAPI:
    app = FastAPI()

    @app.get("/get_server_info")
    async def info():
        return {"context_length": 4096, "tp_size": 8}

    @app.get("/health_generate")
    async def health():
        return JSONResponse({})

    @app.post("/generate")
    async def generate(req: Request):
        body = await req.json()
        SEEN.append(body)
        n = body["sampling_params"]["max_new_tokens"]
        if n > 1000:
            return JSONResponse(
                {"error": {"message": "max_new_tokens too large", "param": "max_new_tokens"}},
                status_code=400,
            )

        async def chunks():
            words = ["alpha", " beta", " gamma", " delta"][:n]
            for i in range(len(words)):
                done = i == len(words) - 1
                meta = {
                    "prompt_tokens": len(body["input_ids"]),
                    "completion_tokens": i + 1,
                    "spec_verify_ct": (i + 2) // 2,
                    "finish_reason": {"type": "length"} if done else None,
                }
                yield f"data: {json.dumps({'text': ''.join(words[: i + 1]), 'meta_info': meta})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def server():
    port = free_port()
    srv = uvicorn.Server(
        uvicorn.Config(fake_sglang(), host="127.0.0.1", port=port, log_level="error")
    )
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True


CFG = EngineConfig.model_validate(
    {
        "kind": "sglang",
        "model": "/models/k",
        "served_name": "kimi",
        "tp_size": 8,
        "sglang": {"draft_model_path": "/d"},
        "params": {"temperature": 0.6, "top_p": 0.95},
    }
)


def test_stream_stats_and_sampling_mapping(server):
    async def go():
        b = RemoteBackend.for_config(server, CFG, tokenizer=None)
        await b.refresh()
        out = [
            d
            async for d in b.stream(
                [1, 2, 3],
                SamplingParams(temperature=0.6, top_p=0.95, top_k=0, max_tokens=4, seed=7),
            )
        ]
        await b.aclose()
        return b, out

    b, out = asyncio.run(go())
    assert b.max_context == 4096
    assert "".join(d.text for d in out) == "alpha beta gamma delta"
    last = out[-1]
    assert (
        last.finish_reason == "length"
        and last.stats.completion_tokens == 4
        and last.stats.verify_rounds == 2
    )
    assert (
        last.stats.tau == 2.0 and last.fingerprint == CFG.fingerprint()
    )  # SGLang sends none: the replica's
    sp = SEEN[-1]["sampling_params"]
    assert sp["top_k"] == -1 and sp["sampling_seed"] == 7 and sp["temperature"] == 0.6


def test_engine_4xx_becomes_an_openai_error_and_params_follow_sglang_rules(server):
    async def go():
        b = RemoteBackend.for_config(server, CFG, tokenizer=None)
        with pytest.raises(InvalidRequest) as e:
            async for _ in b.stream([1], SamplingParams(max_tokens=5000)):
                pass
        assert e.value.status_code == 400 and e.value.param == "max_new_tokens"
        n = len(SEEN)  # not passed on to SGLang: refused by name, nothing sent
        for sp, param in [
            (SamplingParams(logprobs=0), "logprobs"),
            (SamplingParams(logit_bias=((5, 1.0),)), "logit_bias"),
        ]:
            with pytest.raises(InvalidRequest) as e:
                async for _ in b.stream([1], sp):
                    pass
            assert e.value.param == param
        assert len(SEEN) == n
        with pytest.raises(Conflict, match="restart"):
            await b.update_params({"budget": 16})
        before = b.fingerprint
        result = await b.update_params(
            {"temperature": 0.2}
        )  # sampling defaults: applied here, live
        await b.aclose()
        return before, result

    before, result = asyncio.run(go())
    assert result["params"]["temperature"] == 0.2 and result["system_fingerprint"] != before
