"""Added latency of the Ray Serve path over calling the same engine directly.

    python -m ddserve.bench.ray_overhead [--model tiny-random:7] [--requests 48] [--out bench/results]

Deploys one replica on a local loopback Ray cluster, then sends the same requests to (a) the
Serve HTTP proxy and (b) that replica's own engine process (its native OpenAI endpoint),
non-streaming (end-to-end latency) and streaming (time to first token), at concurrency 1
and 16. Prints a table and writes ray_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING", "0")

import httpx  # noqa: E402

from ddserve.errors import EngineError  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def one(client: httpx.AsyncClient, url: str, model: str, stream: bool, i: int) -> float:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Request {i}: say something"}],
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    t0 = time.perf_counter()
    if not stream:
        r = await client.post(url + "/v1/chat/completions", json=body)
        r.raise_for_status()
        return time.perf_counter() - t0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        ttft = None
        async for line in r.aiter_lines():
            if ttft is None and '"content":"' in line and '"content":""' not in line:
                ttft = time.perf_counter() - t0
        if ttft is not None:
            return ttft
    raise EngineError("no token")


async def run_level(url: str, model: str, stream: bool, conc: int, n: int) -> list[float]:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=conc)) as client:
        for i in range(3):  # warm-up, excluded
            await one(client, url, model, stream, -i)
        sem = asyncio.Semaphore(conc)

        async def bounded(i):
            async with sem:
                return await one(client, url, model, stream, i)

        return list(await asyncio.gather(*(bounded(i) for i in range(n))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-random:7")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    import ray
    from ray import serve

    from ddserve.config.deploy import ServeConfig
    from ddserve.serve.registry import published_records
    from ddserve.serve.replica import build_app

    ray.init(num_cpus=2, logging_level="ERROR", log_to_driver=False, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8199})
    cfg = ServeConfig.model_validate(
        {
            "name": "bench",
            "engine": {"model": a.model, "max_context": 512, "params": {"budget": 4, "topk": 2}},
            "replicas": 1,
            "max_ongoing_requests": 64,
        }
    )
    serve.run(build_app(cfg), name="bench", route_prefix="/")
    direct = published_records("bench")[0].engine_url
    paths = {"ray": "http://127.0.0.1:8199", "direct": direct}
    rows = []
    for stream in (False, True):
        for conc in (1, 16):
            res = {
                name: asyncio.run(run_level(url, cfg.engine.model_id, stream, conc, a.requests))
                for name, url in paths.items()
            }
            row = {"metric": "ttft" if stream else "e2e (16 tokens)", "concurrency": conc}
            for name, xs in res.items():
                row[f"{name}_p50_ms"] = round(statistics.median(xs) * 1e3, 2)
                row[f"{name}_p99_ms"] = round(pct(xs, 99) * 1e3, 2)
            row["added_p50_ms"] = round(row["ray_p50_ms"] - row["direct_p50_ms"], 2)
            row["added_p99_ms"] = round(row["ray_p99_ms"] - row["direct_p99_ms"], 2)
            rows.append(row)
            print(row, flush=True)
    serve.shutdown()
    ray.shutdown()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ray_overhead.json").write_text(
        json.dumps({"model": a.model, "requests_per_level": a.requests, "rows": rows}, indent=1)
    )
    print(
        f"\n{'metric':16s} {'C':>3s} {'direct p50':>10s} {'ray p50':>8s} {'added p50':>9s} {'direct p99':>10s} {'ray p99':>8s} {'added p99':>9s}"
    )
    for r in rows:
        print(
            f"{r['metric']:16s} {r['concurrency']:3d} {r['direct_p50_ms']:10.1f} {r['ray_p50_ms']:8.1f} {r['added_p50_ms']:9.1f} {r['direct_p99_ms']:10.1f} {r['ray_p99_ms']:8.1f} {r['added_p99_ms']:9.1f}"
        )


if __name__ == "__main__":
    main()
