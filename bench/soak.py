"""Soak: C streaming clients for a fixed time against a freshly started engine server, with the
server's RSS sampled throughout and hostile requests mixed in.

    python -m ddserve.bench.soak --concurrency 64 --seconds 600 --out bench/results/soak-cpu

Starts `ddserve engine` (the tiny random model by default, so the loop exercises the server
and not the model), runs C closed-loop streaming clients (`bench.load.one_request`) plus one
client sending hostile requests (a 50 MB body, temperature 1e-40, seed 2^64, unknown routes,
malformed JSON, a non-streaming request abandoned mid-way) once a second, and reports:
errors of the well-formed streams, the hostile requests' status codes, end-to-end and TTFT
p50/p99, the server's RSS at start / peak / end, and the client's own CPU (so a saturated
load generator shows). Writes soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from ddserve.backends.process import EngineProcess, free_port
from ddserve.bench.load import one_request, percentile


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024


HOSTILE = [
    ("50MB body", "POST", "/v1/chat/completions", b"x" * (50 << 20)),
    ("temperature 1e-40", "POST", "/v1/chat/completions", {"temperature": 1e-40}),
    ("seed 2^64", "POST", "/v1/chat/completions", {"seed": 2**64}),
    ("unknown route", "GET", "/v1/nothing", None),
    ("wrong method", "DELETE", "/v1/chat/completions", None),
    ("bad json", "POST", "/v1/chat/completions", b"{not json"),
    ("nested json", "POST", "/v1/chat/completions", b"[" * 5000 + b"]" * 5000),
]


async def hostile_loop(url: str, model: str, stop: float, codes: Counter) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        i = 0
        while time.monotonic() < stop:
            name, method, path, payload = HOSTILE[i % len(HOSTILE)]
            i += 1
            kw: dict = {}
            if isinstance(payload, dict):
                kw["json"] = {
                    "model": model,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 8,
                    **payload,
                }
            elif payload is not None:
                kw["content"] = payload
                kw["headers"] = {"content-type": "application/json"}
            try:
                r = await client.request(method, url + path, **kw)
                codes[f"{name}: {r.status_code}"] += 1
            except httpx.HTTPError as exc:
                codes[f"{name}: {type(exc).__name__}"] += 1
            # a non-streaming request whose client leaves before the answer
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "go"}],
                "max_tokens": 400,
                "ignore_eos": True,
            }
            try:
                await client.post(url + "/v1/chat/completions", json=body, timeout=0.2)
            except httpx.TimeoutException:
                codes["abandoned non-streaming: client left"] += 1
            await asyncio.sleep(1.0)


async def soak(url: str, model: str, conc: int, seconds: float, max_tokens: int, pid: int) -> dict:
    stop = time.monotonic() + seconds
    results, rss = [], [rss_mb(pid)]
    codes: Counter = Counter()
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc)

    async def worker(w: int, client: httpx.AsyncClient) -> None:
        n = 0
        while time.monotonic() < stop:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"client {w} request {n}: tell a story"}],
                "max_tokens": max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            }
            results.append(await one_request(client, url, body, timeout=120))
            n += 1

    async def sampler() -> None:
        while time.monotonic() < stop:
            await asyncio.sleep(2.0)
            rss.append(rss_mb(pid))

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.gather(
            *(worker(w, client) for w in range(conc)),
            sampler(),
            hostile_loop(url, model, stop, codes),
        )
    wall = time.monotonic() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    ok = [r for r in results if r.ok]
    errors = Counter(r.error[:80] for r in results if not r.ok)
    return {
        "concurrency": conc,
        "seconds": round(wall, 1),
        "requests": len(results),
        "ok": len(ok),
        "errors": sum(errors.values()),
        "error_kinds": dict(errors),
        "output_tokens": sum(r.tokens for r in ok),
        "output_tok_s": round(sum(r.tokens for r in ok) / wall, 1),
        "e2e_p50_s": percentile([r.e2e_s for r in ok], 0.5),
        "e2e_p99_s": percentile([r.e2e_s for r in ok], 0.99),
        "ttft_p50_s": percentile([r.ttft_s for r in ok], 0.5),
        "ttft_p99_s": percentile([r.ttft_s for r in ok], 0.99),
        "server_rss_mb": {"start": rss[0], "peak": max(rss), "end": rss[-1]},
        "hostile": dict(sorted(codes.items())),
        "client_cpu_s": round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 1),
        "client_cpu_share": round(
            (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / wall, 2
        ),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddserve.bench.soak", description=__doc__)
    p.add_argument("--model", default="tiny-random:7")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--out", default="bench/results/soak")
    a = p.parse_args(argv)
    port = free_port()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    eng = EngineProcess(
        None,
        port=port,
        log_path=str(out / "engine.log"),
        command=[
            sys.executable,
            "-m",
            "ddserve",
            "engine",
            "--port",
            str(port),
            "--model",
            a.model,
            "--max-context",
            "512",
            "--max-batch",
            str(a.max_batch),
            "--drafter",
            "ngram",
            "--budget",
            "4",
            "--topk",
            "2",
        ],
    )
    eng.start()
    try:
        eng.wait_ready(300)
        model = httpx.get(eng.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        res = asyncio.run(
            soak(eng.url, model, a.concurrency, a.seconds, a.max_tokens, eng.proc.pid)
        )
        res["alive_after"] = httpx.get(eng.url + "/health", timeout=30).status_code == 200
    finally:
        eng.stop()
    res["command"] = " ".join(["python -m ddserve.bench.soak", *(argv or sys.argv[1:])])
    res["cpus"] = os.cpu_count()
    (out / "soak.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0 if res["errors"] == 0 and res["alive_after"] else 1


if __name__ == "__main__":
    sys.exit(main())
