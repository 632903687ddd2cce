"""A stub OpenAI-compatible server with known timings: the oracle for load clients
(`ddserve bench`, `bench/crosscheck.py`, tests/bench).

    python -m ddserve.bench.stub_server --port 30200 --ttft-ms 50 --itl-ms 10 --tokens 32

Every chat or text completion yields `max_tokens` tokens (default `--tokens`; one word, one
token, one SSE chunk each, as if `ignore_eos`): the first `--ttft-ms` after the request
arrives, then one every `--itl-ms`, on an absolute schedule (a late wake-up does not push
the later tokens back). With `stream_options.include_usage` a usage chunk follows. A client
at concurrency C that adds nothing of its own measures exactly `ideal()`:

    request time  e2e = ttft + (T - 1) * itl
    throughput    tok/s = C * T / e2e

plus the loopback round trip and the event loop's wake-up delays (well under a millisecond
each on an idle machine). The server does no per-request work beyond formatting JSON, so on
a loaded machine it stays far from its own limit at the rates used here (hundreds to a few
thousand chunks per second).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator

from ddserve.errors import EngineUnavailable

MODEL = "stub"


def ideal(concurrency: int, ttft_ms: float, itl_ms: float, tokens: int) -> dict:
    """What a perfect closed-loop client measures against this server."""
    e2e = (ttft_ms + (tokens - 1) * itl_ms) / 1e3
    return {
        "output_tok_s": concurrency * tokens / e2e,
        "ttft_ms": ttft_ms,
        "itl_ms": itl_ms,
        "e2e_ms": e2e * 1e3,
    }


def make_app(ttft_ms: float, itl_ms: float, tokens: int):
    """The ASGI app (plain ASGI: no framework work per chunk)."""
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()

    async def send_json(send, status: int, body: bytes) -> None:
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def read_body(receive) -> bytes:
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                return body

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        t0 = time.perf_counter()
        path = scope["path"]
        if path in ("/v1/models", "/health"):
            return await send_json(send, 200, models if path == "/v1/models" else b"{}")
        if path not in ("/v1/chat/completions", "/v1/completions"):
            return await send_json(send, 404, b'{"error": {"message": "not found"}}')
        try:
            req = json.loads(await read_body(receive))
        except ValueError:
            return await send_json(send, 400, b'{"error": {"message": "bad json"}}')
        chat = path == "/v1/chat/completions"
        n = int(req.get("max_tokens") or req.get("max_completion_tokens") or tokens)
        prompt = (
            " ".join(str(m.get("content", "")) for m in req.get("messages", []))
            if chat
            else str(req.get("prompt", ""))
        )
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n}
        usage["total_tokens"] = usage["prompt_tokens"] + n
        obj = "chat.completion" if chat else "text_completion"

        def choice(text: str, finish: str | None) -> dict:
            if chat:
                return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        loop = asyncio.get_running_loop()
        start = loop.time() - (time.perf_counter() - t0)  # the request's arrival, loop clock
        if not req.get("stream"):
            await asyncio.sleep(max(0.0, start + (ttft_ms + (n - 1) * itl_ms) / 1e3 - loop.time()))
            text = " tok" * n
            content = (
                {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            )
            body = {"object": obj, "model": MODEL, "usage": usage}
            body["choices"] = [{"index": 0, **content, "finish_reason": "length"}]
            return await send_json(send, 200, json.dumps(body).encode())
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        chunk_obj = obj + ".chunk" if chat else obj

        def event(text: str, finish: str | None) -> bytes:
            chunk = {"id": "stub", "object": chunk_obj, "model": MODEL}
            chunk["choices"] = [choice(text, finish)]
            return b"data: " + json.dumps(chunk).encode() + b"\n\n"

        token, last_token = event(" tok", None), event(" tok", "length")  # formatted once
        for k in range(n):
            due = start + (ttft_ms + k * itl_ms) / 1e3
            await asyncio.sleep(max(0.0, due - loop.time()))
            data = last_token if k == n - 1 else token
            await send({"type": "http.response.body", "body": data, "more_body": True})
        tail = b""
        if (req.get("stream_options") or {}).get("include_usage"):
            last = {
                "id": "stub",
                "object": chunk_obj,
                "model": MODEL,
                "choices": [],
                "usage": usage,
            }
            tail = b"data: " + json.dumps(last).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n"})

    return app


def config(ttft_ms: float, itl_ms: float, tokens: int, port: int = 0):
    import uvicorn

    return uvicorn.Config(
        make_app(ttft_ms, itl_ms, tokens),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        backlog=4096,
    )


@contextlib.contextmanager
def serving(ttft_ms: float, itl_ms: float, tokens: int) -> Iterator[str]:
    """The stub on a free loopback port in a thread of this process; yields its base URL."""
    import uvicorn

    server = uvicorn.Server(config(ttft_ms, itl_ms, tokens))
    thread = threading.Thread(target=server.run, name="stub-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise EngineUnavailable("the stub server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=30200)
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--tokens", type=int, default=32, help="tokens when a request sets none")
    a = p.parse_args(argv)
    uvicorn.Server(config(a.ttft_ms, a.itl_ms, a.tokens, a.port)).run()


if __name__ == "__main__":
    main()
