"""The replica's `x-ddserve-replica` header (ddserve.serve.api_process.ResponseHeader, pure ASGI):
on plain, streamed and error answers alike, without changing their bodies."""

import asyncio

import httpx
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from ddserve.serve.api_process import ResponseHeader


def test_every_answer_carries_the_replica_header():
    app = FastAPI()

    @app.get("/plain")
    async def plain():
        return {"ok": True}

    @app.get("/stream")
    async def stream():
        async def chunks():
            for i in range(3):
                yield f"data: {i}\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    app.add_middleware(ResponseHeader, name="x-ddserve-replica", value="r-7")

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [await c.get(p) for p in ("/plain", "/stream", "/missing")]

    plain_r, stream_r, missing_r = asyncio.run(main())
    assert [r.headers.get("x-ddserve-replica") for r in (plain_r, stream_r, missing_r)] == [
        "r-7"
    ] * 3
    assert plain_r.json() == {"ok": True} and missing_r.status_code == 404
    assert stream_r.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert stream_r.headers["content-type"].startswith("text/event-stream")
