"""bench/api_overhead.py: the real app over an engine stand-in, real HTTP on loopback, the
bundled tokenizer. Its split of a first token's time by prompt length (a benchmark: no timing
is asserted, only that every part is measured and the prompt reached the engine whole)."""

import json
import subprocess
import sys

from ddserve.backends.process import free_port


def test_api_overhead_splits_the_first_token_by_prompt_length(tmp_path):
    r = subprocess.run(
        [
            sys.executable, "-m", "ddserve.bench.api_overhead", "--lengths", "30,3000",
            "--requests", "3", "--port", str(free_port()), "--out", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "api_overhead.json").read_text())["rows"]
    assert [row["prompt_tokens_asked"] for row in rows] == [30, 3000]
    for row in rows:  # the chat template adds a few tokens; nothing is lost
        n = row["prompt_tokens_asked"]
        assert n <= row["prompt_tokens_engine"] <= n + 64
        parts = ("of_it_to_the_app_ms_p50", "before_engine_ms_p50", "after_engine_ms_p50")
        assert all(row[k] > 0 for k in ("ttft_ms_p50", *parts))
        assert row["of_it_to_the_app_ms_p50"] <= row["before_engine_ms_p50"] < row["ttft_ms_p50"]
    assert list(tmp_path.iterdir()) == [tmp_path / "api_overhead.json"]
