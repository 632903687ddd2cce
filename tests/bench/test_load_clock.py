"""`ddserve bench` against a stub server whose timings are known (bench/stub_server.py, real
HTTP on loopback): the load client must measure what the server does — tok/s within 5% of the
ideal the delays imply, TTFT and ITL close to the delays — with warm-up requests still in
flight when the measured ones start (C=4, 2 warm-up) and the workers split over two client
processes. Delays are long (TTFT 100 ms, ITL 20 ms) so that a loaded machine's scheduling
noise stays a small fraction of them."""

import json
import subprocess
import sys

import pytest

from ddserve.bench.stub_server import ideal, serving

TTFT_MS, ITL_MS, TOKENS = 100.0, 20.0, 16  # one request: 100 + 15 * 20 = 400 ms


@pytest.fixture(scope="module")
def stub():
    with serving(TTFT_MS, ITL_MS, TOKENS) as url:
        yield url


def test_measures_the_stubs_known_timings(stub, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "ddserve", "bench", "--no-progress", "--url", stub]
        + ["--concurrency", "4", "--requests", "16", "--warmup", "2"]
        + ["--max-tokens", str(TOKENS), "--prompt-tokens", "24", "--client-procs", "2"]
        + ["--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    lv = json.loads((tmp_path / "bench.json").read_text())["levels"][0]
    want = ideal(4, TTFT_MS, ITL_MS, TOKENS)
    assert lv["errors"] == 0 and lv["requests"] == 16 and lv["output_tokens"] == 16 * TOKENS
    assert abs(lv["output_tok_s"] / want["output_tok_s"] - 1) < 0.05, (lv, want)
    assert TTFT_MS <= lv["ttft_ms_p50"] < TTFT_MS * 1.15
    assert abs(lv["itl_ms_p50"] / ITL_MS - 1) < 0.15
    assert lv["prompt_tokens_mean"] == 24  # the stub counts words: one per synthetic token
    cpu = lv["client_cpu"]
    assert [p["workers"] for p in cpu["procs"]] == [2, 2]
    assert all(0 < p["cpu_per_wall"] < 1 for p in cpu["procs"]) and cpu["cpu_s"] > 0
    assert "client CPU per process" in r.stdout
