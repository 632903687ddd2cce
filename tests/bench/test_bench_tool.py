"""`ddserve bench` against the embedded default engine (SmolLM2-135M, real HTTP on loopback):
a few seconds of smoke load (not a timing assertion), a live-swap sweep through the reconfig
path, and bad input."""

import json
import os
import subprocess
import sys
import tempfile

import httpx
import pytest

from ddserve.backends.process import EngineProcess, free_port

TOKEN = "bench-s3cret"


@pytest.fixture(scope="module")
def engine():
    port = free_port()
    log = os.path.join(tempfile.mkdtemp(prefix="ddserve-bench-"), "engine.log")
    args = ["--budget", "4", "--topk", "2", "--max-context", "1024"]
    eng = EngineProcess(
        None,
        port=port,
        log_path=log,
        admin_token=TOKEN,
        command=[sys.executable, "-m", "ddserve", "engine", "--port", str(port), *args],
    )
    eng.start()
    try:
        eng.wait_ready(300)
        yield eng
    finally:
        eng.stop()


def bench(*args, env=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "ddserve", "bench", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
def test_smoke_levels_table_json_png(engine, tmp_path):
    r = bench(
        "--url",
        engine.url,
        "--concurrency",
        "1,2",
        "--requests",
        "3",
        "--warmup",
        "1",
        "--max-tokens",
        "8",
        "--prompts",
        "humaneval",
        "--out",
        str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "bench.json").read_text())
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 2]
    for lv in res["levels"]:
        assert lv["errors"] == 0 and lv["requests"] == 3
        assert lv["output_tokens"] == 3 * 8  # fixed length (ignore_eos)
        assert lv["output_tok_s"] > 0 and lv["ttft_ms_p50"] > 0
        assert lv["tau_mean"] >= 1.0 and len(lv["tau_per_request"]) == 3
    assert (tmp_path / "bench.png").stat().st_size > 1000
    assert "tok/s" in r.stdout and "TTFT p50" in r.stdout


@pytest.mark.slow
def test_sweep_swaps_live_and_applies_best(engine, tmp_path):
    env = {"DDSERVE_ADMIN_TOKEN": TOKEN, "DDSERVE_STATE_DIR": str(tmp_path / "state")}
    r = bench(
        "--url",
        engine.url,
        "--concurrency",
        "1",
        "--requests",
        "2",
        "--warmup",
        "0",
        "--max-tokens",
        "8",
        "--prompts",
        "chat",
        "--out",
        str(tmp_path),
        "--sweep",
        "budget=0,6",
        "topk=2",
        "--apply-best",
        env=env,
    )
    assert r.returncode == 0, r.stderr
    sw = json.loads((tmp_path / "bench.json").read_text())["sweep"]
    points = {p["params"]["budget"]: p for p in sw["points"]}
    assert set(points) == {0, 6} and all(p["errors"] == 0 for p in points.values())
    assert points[0]["tau_mean"] == 1.0  # budget 0 is autoregressive: the swap was real
    assert sw["best"] in [p["params"] for p in sw["points"]] and sw["applied"]
    info = httpx.get(engine.url + "/server_info").json()
    assert info["config"]["params"]["budget"] == sw["best"]["budget"]
    assert "verified by a real generation" in r.stderr
    # restore the fixture's config for the other tests
    httpx.post(
        engine.url + "/admin/params",
        json={"budget": 4},
        headers={"Authorization": f"Bearer {TOKEN}"},
    ).raise_for_status()


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,needle",
    [
        (["--concurrency", "0"], "levels must be between 1 and 4096"),
        (["--concurrency", "a,b"], "comma list of integers"),
        (["--sweep", "depth=3"], "FIELD one of budget, topk, window"),
        (["--sweep", "budget=x"], "values must be integers"),
        (["--requests", "0"], "--requests and --max-tokens must be >= 1"),
        (["--client-procs", "0"], "expected auto or a number >= 1"),
        (
            ["--prompts", "chat", "--prompt-tokens", "8"],
            "--prompt-tokens goes with --prompts synthetic",
        ),
    ],
)
def test_bad_input_one_line_and_engine_keeps_serving(engine, args, needle):
    r = bench("--url", engine.url, *args, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and needle in r.stderr
    assert httpx.get(engine.url + "/health", timeout=60).status_code == 200


def test_unreachable_endpoint_is_one_line():
    r = bench("--url", f"http://127.0.0.1:{free_port()}", "--requests", "1", timeout=60)
    assert r.returncode == 4 and "no server answers at" in r.stderr
    assert r.stderr.strip().count("\n") == 0


def test_sweep_grid_and_levels_parse():
    from ddserve.cli.bench import parse_levels, parse_sweep

    assert parse_levels("1,4,16") == [1, 4, 16]
    assert parse_sweep(["budget=4,8", "topk=2,4"]) == [
        {"budget": 4, "topk": 2},
        {"budget": 4, "topk": 4},
        {"budget": 8, "topk": 2},
        {"budget": 8, "topk": 4},
    ]
