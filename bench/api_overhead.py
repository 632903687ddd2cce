"""What the API process adds to a request's first token, by prompt length (issue 18: a
~7,200-token prompt's client TTFT on the H200 was ~5-6 ms above the server's own, which starts
once the prompt is tokenised).

    python -m ddserve.bench.api_overhead [--lengths 30,7200] [--requests 30] [--profile]
        [--name api_overhead] [--out bench/results]

The real app (`ddserve.api.app.create_app`: HTTP, JSON, validation, chat template, the
tokenizer's parallel pieces, SSE) served by uvicorn in a child process, over a stand-in for
the engine (`Instant`: no model; it answers a prompt the moment it arrives with one token,
then finishes), with the served model's real tokenizer. The client (httpx, one request at a
time, chat completions as `ddserve bench` sends them) times the first content chunk; the
stand-in records when each prompt reached it and a middleware when each request reached the
app, so the split is: to the app (the client's request, HTTP headers), before the engine
(that, and the body, parse, template, tokenise) and after it (the first chunk's way back). With --profile the
server's cProfile over the run (its functions with the most own time; run one length for
that length's).
Writes NAME.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MODEL = "smollm2-135m"


class Instant:
    """A stand-in for the engine (the API's `Backend`): the first token the moment a prompt
    arrives, the last right after; when each prompt arrived is kept (perf_counter, for the
    client in another process: the clock is the machine's monotonic one)."""

    def __init__(self, tokenizer):
        from ddserve.config.engine import LiveParams

        self._tok, self._params = tokenizer, LiveParams(budget=0, topk=1)
        self.arrivals: list[tuple[int, float]] = []

    model_id = MODEL
    max_context = 16384
    fingerprint = "fp_instant"

    @property
    def tokenizer(self):
        return self._tok

    @property
    def params(self):
        return self._params

    async def stream(self, prompt, sampling):
        from ddserve.api.generation import Delta
        from ddserve.engine.sequence import RequestStats

        self.arrivals.append((len(prompt), time.perf_counter()))
        yield Delta("Hi", [self._tok.convert_tokens_to_ids("Hi")], self.fingerprint)
        yield Delta("", [], self.fingerprint, "length", RequestStats())

    async def check_health(self) -> float:
        return 0.0

    def info(self) -> dict:
        return {"engine": "instant (a stand-in: no model)"}

    async def update_params(self, changes: dict) -> dict:
        return {"params": self._params.model_dump()}

    async def refresh(self) -> None:
        return None


def serve(port: int, profile: bool) -> None:
    """The child: the app over `Instant` on 127.0.0.1:port; on SIGTERM, writes the arrivals
    (and the profile)."""
    import cProfile
    import pstats
    import signal

    import uvicorn

    from ddserve.api.app import create_app, freeze_startup_heap
    from ddserve.engine.weights import load_tokenizer

    backend = Instant(load_tokenizer(MODEL))
    app = create_app(backend, admin_enabled=False, stats_interval_s=0, access_log=False)
    entered: list[float] = []

    @app.middleware("http")
    async def arrival(request, call_next):  # when the request reached the app (headers read)
        if request.url.path.endswith("/completions"):
            entered.append(time.perf_counter())
        return await call_next(request)

    prof = cProfile.Profile() if profile else None
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)

    def stop(*_):
        server.should_exit = True

    signal.signal(signal.SIGTERM, stop)
    freeze_startup_heap()  # as `ddserve engine`'s API processes and the replicas do
    if prof is not None:
        prof.enable()
    server.run()
    if prof is not None:
        prof.disable()
        stats = pstats.Stats(prof)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]
        top = [
            {"function": f"{Path(f).name}:{line}({fn})", "own_ms": round(tt * 1e3, 3), "calls": nc}
            for (f, line, fn), (_, nc, tt, _, _) in rows
        ]
    else:
        top = []
    out = {"arrivals": backend.arrivals, "entered": entered, "profile_top": top}
    Path(os.environ["API_OVERHEAD_OUT"]).write_text(json.dumps(out))


async def client(url: str, prompts: dict[int, list[str]], requests: int) -> list[dict]:
    rows = []
    async with httpx.AsyncClient(timeout=60) as http:
        for n, texts in prompts.items():
            for i in range(requests + 2):  # two untimed
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": texts[i % len(texts)]}],
                    "max_tokens": 2,
                    "stream": True,
                }
                t0 = time.perf_counter()
                first = None
                async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if first is None and line.startswith("data:") and '"content":"Hi"' in line:
                            first = time.perf_counter()
                t1 = time.perf_counter()
                if i >= 2:
                    rows.append({"prompt_tokens": n, "sent": t0, "first": first, "done": t1})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m ddserve.bench.api_overhead")
    ap.add_argument("--lengths", default="30,7200")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--port", type=int, default=30260)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--name", default="api_overhead")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.serve:
        serve(a.port, a.profile)
        return
    from ddserve.bench.prompts import synthetic_set

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = {n: synthetic_set(n, 8, MODEL)[0] for n in lengths}
    side = Path(tempfile.mkdtemp()) / "server.json"  # the child's arrivals and profile
    env = {**os.environ, "API_OVERHEAD_OUT": str(side)}
    cmd = [sys.executable, "-m", "ddserve.bench.api_overhead", "--serve", "--port", str(a.port)]
    cmd += ["--lengths", a.lengths] + (["--profile"] if a.profile else [])
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{a.port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        rows = asyncio.run(client(url, prompts, a.requests))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    server = json.loads(side.read_text())
    # the stand-in saw every request in order: two untimed before each length's timed ones
    timed, it, ent = [], iter(server["arrivals"]), iter(server["entered"])
    for _ in lengths:
        timed += [(*next(it), next(ent)) for _ in range(a.requests + 2)][2:]
    summary = []
    for n in lengths:
        mine = [(r, s) for r, s in zip(rows, timed, strict=True) if r["prompt_tokens"] == n]
        ttft = [1e3 * (r["first"] - r["sent"]) for r, _ in mine]
        before = [1e3 * (s[1] - r["sent"]) for r, s in mine]
        to_app = [1e3 * (s[2] - r["sent"]) for r, s in mine]
        after = [1e3 * (r["first"] - s[1]) for r, s in mine]
        row = {
            "prompt_tokens_asked": n,
            "prompt_tokens_engine": statistics.median(s[0] for _, s in mine),
            "ttft_ms_p50": round(statistics.median(ttft), 3),
            "before_engine_ms_p50": round(statistics.median(before), 3),
            "of_it_to_the_app_ms_p50": round(statistics.median(to_app), 3),
            "after_engine_ms_p50": round(statistics.median(after), 3),
        }
        summary.append(row)
        print(json.dumps(row))
    result = {
        "command": "python -m ddserve.bench.api_overhead " + " ".join(sys.argv[1:]),
        "machine": f"{os.cpu_count()} cores",
        "rows": summary,
        "server_profile_top": server["profile_top"],
    }
    (out / f"{a.name}.json").write_text(json.dumps(result, indent=1))
    for t in server["profile_top"][:15]:
        print(f"{t['own_ms']:10.1f} ms own {t['calls']:6d}x  {t['function']}")


if __name__ == "__main__":
    main()
