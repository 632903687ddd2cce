"""Closed-loop load against an OpenAI-compatible endpoint: the engine of `ddserve bench`.

A level at concurrency C has two phases, as in aiperf. Warm-up: the first `warmup` requests,
at most C at a time; every one of them finishes before the measured phase starts. Measured:
C workers send the level's `requests` back to back (each worker its next request as soon as
its last one ends). The level's clock is aiperf's benchmark duration: from the first measured
request's start to the last measured request's end, so the window holds measured work only,
and output tok/s = the measured requests' output tokens / that window (requests/s likewise).

The C workers can be spread over N processes (`procs`: ddserve.bench.load_procs.run_level), each on
its own event loop, all taking request numbers from one shared counter, a barrier starting
the measured phase in every process at once; timestamps are `time.perf_counter`
(CLOCK_MONOTONIC: one clock for every process on the machine) and the results are merged.
Each process reports the CPU it used in the measured phase (user + sys seconds, getrusage)
over its wall time: an event loop near 1.0 is saturated, and the level then measures the
client, not the server.

Requests go through bench/http1.py, a minimal HTTP/1.1 client (about a quarter of httpx's CPU
per streamed chunk), on uvloop when it is installed; `RequestSpec.transport="httpx"`
(`ddserve bench --transport httpx`) goes through httpx instead, as bench/soak.py does.

Per request: time to first token (first content chunk), inter-token latency (gaps between
content chunks divided by the tokens they carry when the server says so, else per chunk),
output and prompt tokens (the `usage` of the last chunk) and, from ddserve's `ddtree`
extension, the accept length tau. Per level: output tok/s and requests/s over the window,
the mean number of requests in flight (C for a client that loses no time between requests),
TTFT, ITL and end-to-end p50/p99, mean tau and its per-request distribution, errors, and the
client's CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from ddserve.bench.http1 import Pool
from ddserve.errors import EngineError

SATURATED = 0.85  # a client process busier than this (cores) may be what limits the level


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    tau: float | None = None
    error: str = ""
    prompt_tokens: int | None = None
    start: float = 0.0  # perf_counter when the worker sent it (set by the closed loop)
    end: float = 0.0  # perf_counter when its `send` returned


@dataclass
class RequestSpec:
    """What every request of a level carries (picklable: it travels to client processes)."""

    url: str
    model: str
    prompts: list[str]
    max_tokens: int
    temperature: float
    ignore_eos: bool
    timeout: float
    headers: dict[str, str] | None = None
    transport: str = "http1"  # bench/http1.py; "httpx" for comparison

    def body(self, i: int) -> dict:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": self.prompts[i % len(self.prompts)]}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True  # extension (ddserve, SGLang, vLLM): fixed length
        return body


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class SSE:
    """One OpenAI stream's timing and counts, fed the response body's bytes as they arrive.
    Chunks that arrive in one network read share its timestamp (they did arrive together)."""

    def __init__(self):
        self.buf = b""
        self.first: float | None = None
        self.last = 0.0
        self.gaps: list[float] = []
        self.tokens, self.tau, self.prompt_tokens = 0, None, None
        self.error = ""

    def feed(self, data: bytes) -> bool:
        """Take the next bytes; True when the stream carried an error (stop reading)."""
        now = time.perf_counter()
        *lines, self.buf = (self.buf + data).split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            chunk = json.loads(payload)
            if "error" in chunk:
                self.error = str(chunk["error"])[:200]
                return True
            delta = (chunk.get("choices") or [{}])[0].get("delta", {})
            if delta.get("content"):
                if self.first is None:
                    self.first = now
                else:
                    self.gaps.append(now - self.last)
                self.last = now
            if usage := chunk.get("usage"):
                self.tokens = usage.get("completion_tokens", self.tokens)
                self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            if chunk.get("ddtree"):
                self.tau = chunk["ddtree"].get("accept_length", self.tau)
        return False

    def result(self, t0: float, end: float) -> RequestResult:
        if self.error:
            return RequestResult(False, error=self.error)
        if self.first is None:
            return RequestResult(False, e2e_s=end - t0, error="no content in the stream")
        # a chunk can carry several tokens (one DDTree round); spread each gap over them
        n_chunks = len(self.gaps) + 1
        per = max(1, self.tokens) / n_chunks if self.tokens else 1.0
        itl = [g / per for g in self.gaps]
        tokens = self.tokens or n_chunks
        return RequestResult(
            True, self.first - t0, end - t0, tokens, itl, self.tau, prompt_tokens=self.prompt_tokens
        )


async def stream_request(pool: Pool, body: dict, timeout: float) -> RequestResult:
    """One streaming chat completion through the bench's own HTTP/1.1 client (bench/http1)."""
    t0 = time.perf_counter()
    sse = SSE()
    try:
        async with asyncio.timeout(timeout):
            async with pool.post("/v1/chat/completions", json.dumps(body).encode()) as r:
                if r.status != 200:
                    text = b"".join([piece async for piece in r.body()]).decode(errors="replace")
                    return RequestResult(False, error=f"HTTP {r.status}: {text[:200]}")
                async for data in r.body():
                    if sse.feed(data):
                        break
    except TimeoutError:
        return RequestResult(False, error=f"TimeoutError: no complete answer in {timeout:g} s")
    except (OSError, EngineError, asyncio.IncompleteReadError, ValueError) as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}"[:200])
    return sse.result(t0, time.perf_counter())


async def one_request(
    client: httpx.AsyncClient, url: str, body: dict, timeout: float
) -> RequestResult:
    """The same through httpx (bench/soak.py; `RequestSpec.transport="httpx"`)."""
    t0 = time.perf_counter()
    sse = SSE()
    try:
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=body, timeout=timeout
        ) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return RequestResult(False, error=f"HTTP {r.status_code}: {text[:200]}")
            async for data in r.aiter_bytes():
                if sse.feed(data):
                    break
    except (httpx.HTTPError, ValueError) as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}"[:200])
    return sse.result(t0, time.perf_counter())


class Tickets:
    """Request numbers of one phase, handed out once each: a local counter, or (`shared`, a
    multiprocessing.Value) one counter for every client process."""

    def __init__(self, total: int, shared=None):
        self.total, self.shared, self.next = total, shared, 0

    def take(self) -> int | None:
        if self.shared is None:
            i, self.next = self.next, self.next + 1
        else:
            with self.shared.get_lock():
                i = self.shared.value
                self.shared.value = i + 1
        return i if i < self.total else None


Send = Callable[[int], Awaitable[RequestResult]]


async def drain(send: Send, workers: int, tickets: Tickets, offset: int, on_done=None) -> list:
    """`workers` coroutines send request `offset + i` for every ticket i, back to back."""
    results: list[RequestResult] = []

    async def worker():
        while (i := tickets.take()) is not None:
            t0 = time.perf_counter()
            res = await send(offset + i)
            res.start, res.end = t0, time.perf_counter()
            results.append(res)
            if on_done:
                on_done()

    await asyncio.gather(*(worker() for _ in range(workers)))
    return results


def cpu_seconds() -> tuple[float, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime


async def phases(
    send: Send,
    workers: int,
    warm: Tickets,
    measured: Tickets,
    warmup: int,
    on_done=None,
    barrier=None,
) -> tuple[list[RequestResult], dict]:
    """Warm-up to completion, (every process at the barrier,) then the measured phase; the
    measured results and this process's CPU over the measured phase."""
    await drain(send, max(1, min(workers, warmup)), warm, 0, on_done)
    if barrier is not None:
        barrier.wait()
    (u0, s0), t0 = cpu_seconds(), time.perf_counter()
    results = await drain(send, workers, measured, warmup, on_done)
    (u1, s1), wall = cpu_seconds(), time.perf_counter() - t0
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]  # uvloop or asyncio
    cpu = {"workers": workers, "loop": loop}
    cpu.update(user_s=round(u1 - u0, 3), sys_s=round(s1 - s0, 3))
    cpu["wall_s"] = round(wall, 3)
    cpu["cpu_per_wall"] = round((u1 - u0 + s1 - s0) / wall, 3) if wall > 0 else 0.0
    return results, cpu


async def closed_loop(
    send: Send, concurrency: int, requests: int, warmup: int, on_done=None
) -> dict:
    """C workers call `send(i)` (a coroutine returning a RequestResult) for i = 0, 1, ...:
    the warm-up requests first, to completion, then the measured ones; the level's figures
    over the measured ones (module docstring). CPU is this whole process's."""
    results, cpu = await phases(
        send, concurrency, Tickets(warmup), Tickets(requests), warmup, on_done
    )
    return summarize(results, concurrency, [cpu])


@contextlib.asynccontextmanager
async def sender(spec: RequestSpec, workers: int):
    """`send(i)` over the spec's transport, its connections closed at the end."""
    if spec.transport == "httpx":
        limits = httpx.Limits(max_connections=workers + 4, max_keepalive_connections=workers)
        async with httpx.AsyncClient(limits=limits, headers=spec.headers) as client:

            async def send(i: int) -> RequestResult:
                return await one_request(client, spec.url, spec.body(i), spec.timeout)

            yield send
        return
    pool = Pool(spec.url, spec.headers)

    async def send(i: int) -> RequestResult:
        return await stream_request(pool, spec.body(i), spec.timeout)

    try:
        yield send
    finally:
        await pool.close()


def run_loop(coro):
    """Run a client's event loop: uvloop when installed (less CPU per chunk), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def summarize(results: list[RequestResult], concurrency: int, cpus: list[dict]) -> dict:
    """A level's figures from its measured requests (merged from every client process)."""
    ok = [r for r in results if r.ok]
    itl = [x for r in ok for x in r.itl_s]
    taus = [r.tau for r in ok if r.tau is not None]
    tokens = sum(r.tokens for r in ok)
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    wall = max(r.end for r in results) - min(r.start for r in results) if results else 0.0
    busy = sum(r.end - r.start for r in results)
    cpu_s = sum(c["user_s"] + c["sys_s"] for c in cpus)

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
        # requests in flight on average over the window: C for a client without dead time
        "concurrency_mean": round(busy / wall, 2) if wall > 0 else 0.0,
        "prompt_tokens_mean": round(sum(prompt) / len(prompt), 1) if prompt else None,
        "ttft_ms_p50": ms(percentile([r.ttft_s for r in ok], 0.5)),
        "ttft_ms_p99": ms(percentile([r.ttft_s for r in ok], 0.99)),
        "itl_ms_p50": ms(percentile(itl, 0.5)),
        "itl_ms_p99": ms(percentile(itl, 0.99)),
        "e2e_ms_p50": ms(percentile([r.e2e_s for r in ok], 0.5)),
        "tau_mean": round(sum(taus) / len(taus), 3) if taus else None,
        "tau_per_request": [round(t, 3) for t in taus],
        "client_cpu": {
            "procs": cpus,
            "cpu_s": round(cpu_s, 3),
            "cores": round(cpu_s / wall, 3) if wall > 0 else 0.0,
            "max_proc_cpu_per_wall": max((c["cpu_per_wall"] for c in cpus), default=0.0),
        },
    }
