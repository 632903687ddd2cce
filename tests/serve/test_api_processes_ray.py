"""A replica with extra API processes (`api_server_count`, ddserve.serve.api_process) behind
Ray's real HAProxy ingress: a Ray head of its own (its own temporary directory and GCS port,
so the session's two-node cluster is untouched), `ddserve up` and `ddserve reconfig` as a
user runs them, the official `openai` client and plain HTTP through HAProxy."""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest

from ddserve.serve.cluster import HAPROXY_ENV, session_members
from tests.api.conftest import free_port

MODEL = "tiny-random:7"
NAME = "hpapi"


def _ddserve(env, *args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddserve", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _kill_session(sid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_members(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + 10
        while session_members(sid) and time.time() < deadline:
            time.sleep(0.2)


@pytest.fixture(scope="module")
def hp_app():
    tmp = Path(tempfile.mkdtemp(prefix="ddhp", dir="/tmp"))  # short: Ray's socket paths
    gcs, http = free_port(), free_port()
    env = {
        **os.environ,
        **HAPROXY_ENV,
        "TMPDIR": str(tmp),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_metrics_report_interval_ms": "1000",
        "DDSERVE_THREADS": "1",
    }
    head = subprocess.Popen(
        ["ray", "start", "--head", "--disable-usage-stats", "--num-cpus", "2"]
        + ["--node-ip-address", "127.0.0.1", "--port", str(gcs), "--dashboard-port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    out, _ = head.communicate(timeout=120)
    assert head.returncode == 0, out
    cfg = tmp / "hp.yaml"
    cfg.write_text(
        f"name: {NAME}\n"
        f"engine: {{kind: builtin, model: '{MODEL}', device: cpu, max_batch: 8}}\n"
        f"http: {{host: 127.0.0.1, port: {http}, ingress: haproxy}}\n"
        "api_server_count: 2\n"
        # autoscaling on the engines' count (ddserve.serve.autoscaling): quick to react, and
        # a target the short bursts of the other tests stay under for less than the delay
        "replicas: {min: 1, max: 2, target_ongoing_requests: 12, upscale_delay_s: 3,"
        " downscale_delay_s: 600, metrics_interval_s: 0.5, look_back_period_s: 2}\n"
        "health: {period_s: 2, timeout_s: 30, recent_traffic_s: 1}\n"
    )
    address = f"127.0.0.1:{gcs}"
    try:
        up = _ddserve(env, "up", "--config", str(cfg), "--address", address)
        assert up.returncode == 0, up.stdout + up.stderr
        yield {"base": f"http://127.0.0.1:{http}", "env": env, "cfg": cfg, "address": address}
    finally:
        _ddserve(env, "down", "--config", str(cfg), "--address", address, timeout=120)
        _kill_session(head.pid)
        shutil.rmtree(tmp, ignore_errors=True)


async def _many(base: str, path: str, n: int, body: dict | None = None) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base, timeout=60) as c:
        if body is None:
            return await asyncio.gather(*[c.get(path) for _ in range(n)])
        return await asyncio.gather(*[c.post(path, json=body) for _ in range(n)])


def _processes_answering(base: str) -> Counter:
    """Which API process answered each of many concurrent /server_info calls, asked until
    both have answered or 60 s have passed (a replica just started hands its socket to the
    extra process a moment after Serve routes to it; on a loaded 2-core CI machine that
    moment was longer than ten quick rounds)."""
    seen: Counter = Counter()
    deadline = time.time() + 60
    while time.time() < deadline:
        for r in asyncio.run(_many(base, "/server_info", 16)):
            assert r.status_code == 200, r.text
            a = r.json()["api_server"]
            seen[(a["index"], a["count"], a["pid"])] += 1
        if len({k[0] for k in seen}) == 2:
            break
        time.sleep(0.5)
    return seen


def test_both_api_processes_serve_the_replicas_port(hp_app):
    seen = _processes_answering(hp_app["base"])
    assert {(i, n) for i, n, _ in seen} == {(0, 2), (1, 2)}, seen
    assert len({pid for _, _, pid in seen}) == 2
    # the official client, streamed, through HAProxy; every answer says the same replica
    client = openai.OpenAI(base_url=hp_app["base"] + "/v1", api_key="none")
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
    )
    assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) >= 1
    rs = asyncio.run(
        _many(
            hp_app["base"], "/v1/completions", 16, {"model": MODEL, "prompt": "a", "max_tokens": 4}
        )
    )
    assert {r.status_code for r in rs} == {200}
    assert len({r.headers["x-ddserve-replica"] for r in rs}) == 1
    # Serve's system routes answer on every process of the port (HAProxy's health check)
    for r in asyncio.run(_many(hp_app["base"], "/-/healthz", 8)):
        assert r.status_code == 200 and r.text == "success"


def _ray_requests_total(tmpdir: str) -> float:
    sd = Path(tmpdir) / "ray" / "session_latest" / "prom_metrics_service_discovery.json"
    total = 0.0
    for target in json.loads(sd.read_text())[0]["targets"]:
        try:
            text = httpx.get(f"http://{target}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        for line in text.splitlines():
            if line.startswith("ray_ddserve_requests_total{") and f'application="{NAME}"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_of_every_process_reach_ray(hp_app):
    tmpdir = hp_app["env"]["TMPDIR"]
    before = _ray_requests_total(tmpdir)
    # enough requests at once that both processes serve some (asserted by the test above)
    body = {"model": MODEL, "prompt": "count", "max_tokens": 3}
    rs = asyncio.run(_many(hp_app["base"], "/v1/completions", 24, body))
    assert {r.status_code for r in rs} == {200}
    deadline, now = time.time() + 30, before
    while time.time() < deadline:
        now = _ray_requests_total(tmpdir)
        if now >= before + 24:
            break
        time.sleep(1)
    # health probes may add a few; none of the 24 may be missing
    assert now >= before + 24, (before, now)


def test_live_reconfig_is_in_force_in_every_process(hp_app):
    r = _ddserve(
        hp_app["env"],
        "reconfig",
        "set",
        "temperature=0.5",
        "--config",
        str(hp_app["cfg"]),
        "--address",
        hp_app["address"],
    )
    assert r.returncode == 0, r.stdout + r.stderr
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    fps = {
        x.json()["system_fingerprint"]
        for x in asyncio.run(_many(hp_app["base"], "/v1/completions", 16, body))
    }
    temps = Counter()
    for x in asyncio.run(_many(hp_app["base"], "/server_info", 32)):
        info = x.json()
        temps[(info["api_server"]["index"], info["config"]["params"]["temperature"])] += 1
    assert len(fps) == 1
    assert {t for _, t in temps} == {0.5}, temps


def test_a_dead_api_process_takes_its_replica_down_and_serve_replaces_it(hp_app):
    seen = _processes_answering(hp_app["base"])
    extra = next(pid for i, _, pid in seen if i == 1)
    old = httpx.get(hp_app["base"] + "/server_info", timeout=10).headers["x-ddserve-replica"]
    os.kill(extra, signal.SIGKILL)
    deadline = time.time() + 120
    new = old
    while time.time() < deadline:
        try:
            r = httpx.post(
                hp_app["base"] + "/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                timeout=10,
            )
            if r.status_code == 200:
                new = r.headers["x-ddserve-replica"]
                if new != old:
                    break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    assert new != old, "Serve did not replace the replica whose API process died"
    seen = _processes_answering(hp_app["base"])
    assert {i for i, _, _ in seen} == {0, 1} and extra not in {p for _, _, p in seen}


def _replicas(hp_app) -> list[dict]:
    """The replicas `ddserve status` shows alive (a replaced one's record stays a while,
    DEAD)."""
    r = _ddserve(
        hp_app["env"],
        "status",
        "--json",
        "--config",
        str(hp_app["cfg"]),
        "--address",
        hp_app["address"],
    )
    rows = json.loads(r.stdout)["replicas"] if r.stdout.strip().startswith("{") else []
    return [x for x in rows if x["state"] in ("STARTING", "RUNNING", "UNHEALTHY")]


def test_autoscaling_counts_the_requests_of_every_api_process(hp_app):
    """16 requests at once on one replica, target 12 per replica: Serve's own count is the
    replica's own process's share (about half, as HAProxy's connections spread over both),
    under the target, so its default policy would keep one replica; the engine counts all
    16 (8 running, 8 waiting: max_batch 8), and the deployment scales to two."""
    assert len(_replicas(hp_app)) == 1
    body = {"model": MODEL, "prompt": "go", "max_tokens": 200, "ignore_eos": True}

    async def load(stop: asyncio.Event):
        async with httpx.AsyncClient(base_url=hp_app["base"], timeout=120) as c:

            async def one():
                while not stop.is_set():
                    r = await c.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text

            await asyncio.gather(*[one() for _ in range(16)])

    async def main():
        stop = asyncio.Event()
        task = asyncio.ensure_future(load(stop))
        deadline, n = time.time() + 90, 1
        while time.time() < deadline and n < 2:
            await asyncio.sleep(2)
            n = len(await asyncio.to_thread(_replicas, hp_app))
        stop.set()
        await task
        return n

    assert asyncio.run(main()) == 2, "the deployment did not scale to two replicas"


def test_deleting_the_app_lets_every_process_finish_its_streams(hp_app):
    """Last in the module: `ddserve down` while streams run on every process; each ends with
    its finish and all its tokens (the extra processes drain once Serve stops accepting, and
    their exits then do not take the replica down under the replica's own streams)."""
    body = {
        "model": MODEL,
        "prompt": "go",
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def one(c):
        usage, finish = None, None
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    d = json.loads(line[6:])
                    for ch in d.get("choices", []):
                        finish = ch.get("finish_reason") or finish
                    usage = d.get("usage") or usage
        return finish, (usage or {}).get("completion_tokens")

    async def main():
        async with httpx.AsyncClient(base_url=hp_app["base"], timeout=120) as c:
            streams = [asyncio.ensure_future(one(c)) for _ in range(8)]
            await asyncio.sleep(1.0)
            down = asyncio.ensure_future(
                asyncio.to_thread(
                    _ddserve,
                    hp_app["env"],
                    "down",
                    "--config",
                    str(hp_app["cfg"]),
                    "--address",
                    hp_app["address"],
                )
            )
            return await asyncio.gather(*streams), await down

    seen = _processes_answering(hp_app["base"])
    assert {i for i, _, _ in seen} == {0, 1}
    results, down = asyncio.run(main())
    assert down.returncode == 0, down.stdout + down.stderr
    assert results == [("length", 300)] * 8, results
