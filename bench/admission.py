"""Running streams while a long prompt is admitted: do they stall? (issue 18)

N streams (short chat prompts, fixed-length answers) run against a served endpoint; after
`--delay` seconds one long synthetic prompt arrives. Every content chunk of every stream is
timestamped, so the gaps a user sees (time between chunks of one stream) are read overall and
inside the admission window (from the long prompt's send to its first token, plus one
overall ITL p99): p50, p99 and the longest gap, and the long prompt's TTFT.

    python -m ddserve.bench.admission --url http://127.0.0.1:30000 [--streams 15]
        [--stream-tokens 1024] [--long-tokens 7200] [--delay 0.5] [--out FILE.json]

The engine's chunked prefill (--chunked-prefill-steps paces it, within --chunked-prefill-size)
is what bounds the gaps; run it against servers with different settings side by side
(bench/long_context.sh does). Let the streams reach steady state first (--delay): a fresh
CPU server's first rounds are slow, and a gap that began before the long prompt was sent
counts if it ended after (`longest_gap_ended_ms_after_send` says where the longest ended).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import httpx

from ddserve.bench.http1 import Pool
from ddserve.bench.load import percentile
from ddserve.bench.prompts import CHAT_PROMPTS, synthetic_set
from ddserve.errors import EngineError


async def stream(pool: Pool, body: dict, stamps: list[float]) -> int:
    """One streaming chat completion; appends the arrival time of each content chunk.
    Returns the completion tokens the usage chunk reports."""
    tokens, buf = 0, b""
    async with pool.post("/v1/chat/completions", json.dumps(body).encode()) as r:
        if r.status != 200:
            text = b"".join([p async for p in r.body()]).decode(errors="replace")
            raise EngineError(f"HTTP {r.status}: {text[:200]}")
        async for data in r.body():
            now = time.perf_counter()
            *lines, buf = (buf + data).split(b"\n")
            for line in lines:
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise EngineError(str(chunk["error"])[:200])
                if (chunk.get("choices") or [{}])[0].get("delta", {}).get("content"):
                    stamps.append(now)
                if usage := chunk.get("usage"):
                    tokens = usage.get("completion_tokens", tokens)
    return tokens


def gaps_ms(stamps: list[float], lo: float = float("-inf"), hi: float = float("inf")):
    """Gaps between consecutive chunks of one stream that end inside [lo, hi], in ms."""
    return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:], strict=False) if lo <= b <= hi]


def summary(gaps: list[float]) -> dict:
    return {
        "n": len(gaps),
        "p50_ms": round(percentile(gaps, 0.5) or 0, 3),
        "p99_ms": round(percentile(gaps, 0.99) or 0, 3),
        "max_ms": round(max(gaps, default=0), 3),
    }


async def run(a) -> dict:
    model = a.model or httpx.get(a.url + "/v1/models").json()["data"][0]["id"]
    long_prompt, how = synthetic_set(a.long_tokens, 1, model, a.tokenizer)
    headers = (
        {"authorization": "Bearer " + os.environ["DDSERVE_API_KEY"]}
        if os.environ.get("DDSERVE_API_KEY")
        else None
    )
    pool = Pool(a.url, headers)

    def body(prompt: str, n: int) -> dict:
        return {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": n,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    # warm-up: the long prompt's shapes (prefill chunks) and a short stream, unmeasured
    await stream(pool, body(long_prompt[0], 2), [])
    await stream(pool, body(CHAT_PROMPTS[0], 8), [])
    stamps: list[list[float]] = [[] for _ in range(a.streams)]
    runs = [
        asyncio.create_task(
            stream(pool, body(CHAT_PROMPTS[i % len(CHAT_PROMPTS)], a.stream_tokens), stamps[i])
        )
        for i in range(a.streams)
    ]
    await asyncio.sleep(a.delay)
    long_stamps: list[float] = []
    sent = time.perf_counter()
    await stream(pool, body(long_prompt[0], a.long_max_tokens), long_stamps)
    first = long_stamps[0] if long_stamps else time.perf_counter()
    await asyncio.gather(*runs)
    await pool.close()
    every = [g for s in stamps for g in gaps_ms(s)]
    window_hi = first + (percentile(every, 0.99) or 0) / 1e3
    during = [g for s in stamps for g in gaps_ms(s, sent, window_hi)]
    still = sum(1 for s in stamps if s and s[-1] > first)  # streams still running after
    # where the longest gap in the window ended, after the long prompt was sent (a first-use
    # cost, the first chunk, the newcomer's first step: a timeline tells them apart)
    ends = [
        (b - a, b) for s in stamps for a, b in zip(s, s[1:], strict=False) if sent <= b <= window_hi
    ]
    out = {
        "url": a.url,
        "model": model,
        "streams": a.streams,
        "stream_tokens": a.stream_tokens,
        "long_prompt": how,
        "long_ttft_ms": round((first - sent) * 1e3, 3),
        "streams_running_at_admission": still,
        "all": summary(every),
        "admission_window": summary(during),
        "longest_gap_ended_ms_after_send": round((max(ends)[1] - sent) * 1e3, 1) if ends else None,
    }
    out["admission_p99_over_all_p50"] = round(
        out["admission_window"]["p99_ms"] / max(out["all"]["p50_ms"], 1e-9), 2
    )
    out["admission_max_over_all_p50"] = round(
        out["admission_window"]["max_ms"] / max(out["all"]["p50_ms"], 1e-9), 2
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model")
    ap.add_argument("--tokenizer", help="model spec whose tokenizer counts the long prompt")
    ap.add_argument("--streams", type=int, default=15)
    ap.add_argument("--stream-tokens", type=int, default=1024)
    ap.add_argument("--long-tokens", type=int, default=7200)
    ap.add_argument("--long-max-tokens", type=int, default=16)
    ap.add_argument("--delay", type=float, default=0.5)
    ap.add_argument("--out")
    a = ap.parse_args()
    res = asyncio.run(run(a))
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
