"""Closed-loop load against an OpenAI-compatible endpoint: the engine of `ddserve bench`.

At each concurrency level C, C workers send streaming chat requests back to back until the
level's request count is done; the first `warmup` requests of a level are not counted. Per
request: time to first token (first content chunk), inter-token latency (gaps between
content chunks divided by the tokens they carry when the server says so, else per chunk),
output tokens (the `usage` of the last chunk) and, from ddserve's `ddtree` extension, the
accept length tau. Per level: output tok/s and requests/s over the level's wall time, TTFT
and ITL p50/p99, mean tau and its per-request distribution, errors.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    tau: float | None = None
    error: str = ""


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def one_request(
    client: httpx.AsyncClient, url: str, body: dict, timeout: float
) -> RequestResult:
    t0 = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    tokens, tau = 0, None
    try:
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=body, timeout=timeout
        ) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return RequestResult(False, error=f"HTTP {r.status_code}: {text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(False, error=str(chunk["error"])[:200])
                now = time.perf_counter()
                delta = (chunk.get("choices") or [{}])[0].get("delta", {})
                if delta.get("content"):
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                if chunk.get("usage"):
                    tokens = chunk["usage"].get("completion_tokens", tokens)
                if chunk.get("ddtree"):
                    tau = chunk["ddtree"].get("accept_length", tau)
    except (httpx.HTTPError, ValueError) as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}"[:200])
    end = time.perf_counter()
    if first is None:
        return RequestResult(False, e2e_s=end - t0, error="no content in the stream")
    # a chunk can carry several tokens (one DDTree round); spread each gap over them
    n_chunks = len(gaps) + 1
    per = max(1, tokens) / n_chunks if tokens else 1.0
    itl = [g / per for g in gaps]
    return RequestResult(True, first - t0, end - t0, tokens or n_chunks, itl, tau)


async def run_level(
    url: str,
    model: str,
    prompts: list[str],
    concurrency: int,
    requests: int,
    warmup: int,
    max_tokens: int,
    temperature: float,
    ignore_eos: bool,
    timeout: float,
    on_done=None,
    headers: dict[str, str] | None = None,
) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, headers=headers) as client:

        async def send(i: int) -> RequestResult:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                "max_tokens": max_tokens,
                "temperature": temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if ignore_eos:
                body["ignore_eos"] = True  # extension (ddserve, SGLang, vLLM): fixed length
            return await one_request(client, url, body, timeout)

        return await closed_loop(send, concurrency, requests, warmup, on_done)


async def closed_loop(send, concurrency: int, requests: int, warmup: int, on_done=None) -> dict:
    """C workers call `send(i)` (i = 0, 1, ...; a coroutine returning a RequestResult) back
    to back until warmup + requests are done; the level's figures over the counted ones."""
    counter = iter(range(10**9))
    results: list[RequestResult] = []
    t_start: list[float] = []
    total = requests + warmup

    async def worker():
        while True:
            i = next(counter)
            if i >= total:
                return
            if i == warmup:
                t_start.append(time.perf_counter())
            res = await send(i)
            if i >= warmup:
                results.append(res)
            if on_done:
                on_done()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - (t_start[0] if t_start else t0)
    ok = [r for r in results if r.ok]
    itl = [x for r in ok for x in r.itl_s]
    taus = [r.tau for r in ok if r.tau is not None]
    tokens = sum(r.tokens for r in ok)

    def ms(x):
        return None if x is None else round(x * 1e3, 2)

    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if not r.ok})[:3],
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 2) if wall > 0 else 0.0,
        "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else 0.0,
        "ttft_ms_p50": ms(percentile([r.ttft_s for r in ok], 0.5)),
        "ttft_ms_p99": ms(percentile([r.ttft_s for r in ok], 0.99)),
        "itl_ms_p50": ms(percentile(itl, 0.5)),
        "itl_ms_p99": ms(percentile(itl, 0.99)),
        "e2e_ms_p50": ms(percentile([r.e2e_s for r in ok], 0.5)),
        "tau_mean": round(sum(taus) / len(taus), 3) if taus else None,
        "tau_per_request": [round(t, 3) for t in taus],
    }
