"""The scheduler's log line (`--decode-log-interval`, ddserve.engine.round_log)."""

from __future__ import annotations

import asyncio
import logging
import re

import torch

from ddserve.config.engine import EngineConfig
from ddserve.engine.round_log import RoundLog
from ddserve.engine.runner import EngineRunner
from ddserve.engine.sampling import SamplingParams

LINE = re.compile(
    r"Decode batch\. #running-req: (\d+), #queue-req: (\d+), gen throughput \(token/s\): "
    r"([\d.]+), rounds: (\d+): (\d+) decode ([\d.]+) ms"
    r"(?:, (\d+) prefill ([\d.]+) ms \((\d+) prompt tokens\) \+ decode ([\d.]+) ms)?$"
)


def test_a_line_every_interval_with_the_means_of_each_kind_of_round():
    rl = RoundLog(3)
    assert rl.record(0, 0.0, 0.002, 4, 4, 0) is None
    assert rl.record(512, 0.004, 0.003, 4, 5, 1) is None
    line = rl.record(256, 0.002, 0.001, 5, 5, 0)
    m = LINE.match(line)
    assert m, line
    running, queued, _, rounds, plain, plain_ms, pre, chunk_ms, tokens, step_ms = m.groups()
    assert (running, queued, rounds, plain, pre, tokens) == ("5", "0", "3", "1", "2", "768")
    assert float(plain_ms) == 2.0 and float(chunk_ms) == 3.0 and float(step_ms) == 2.0
    # the next interval starts from nothing: a decode-only one has no prefill part
    for _ in range(2):
        assert rl.record(0, 0.0, 0.001, 1, 1, 0) is None
    line = rl.record(0, 0.0, 0.001, 1, 1, 0)
    m = LINE.match(line)
    assert m and m.group(4) == m.group(5) == "3" and m.group(7) is None, line
    assert RoundLog(0).record(100, 1.0, 1.0, 1, 1, 0) is None  # 0: never
    # a round that did nothing (its requests all gone) is not one; a round that prefilled
    # with nothing to decode leaves the mean of the decodes after a chunk alone
    rl = RoundLog(2)
    assert rl.record(0, 0.0, 0.0, 0, 0, 0) is None
    assert rl.record(300, 0.003, 0.0, 0, 0, 1) is None
    m = LINE.match(rl.record(200, 0.001, 0.002, 3, 3, 0))
    assert m and m.group(4) == "2" and m.group(7) == "2" and m.group(9) == "500", m
    assert float(m.group(8)) == 2.0 and float(m.group(10)) == 2.0


def test_the_runner_logs_its_rounds_while_a_long_prompt_goes_in_between_them(caplog):
    """A 300-token prompt joins a decoding request in 16-token chunks: the lines say so (rounds
    that prefill, and the prompt tokens they took: all of them once the prompt is in), and
    count every round and every generated token's throughput."""
    cfg = EngineConfig(
        model="tiny-random",
        device="cpu",
        max_batch=2,
        chunked_prefill_size=16,
        chunked_prefill_steps=0,
        decode_log_interval=4,
        drafter={"kind": "none"},
        params={"budget": 0},
    )
    runner = EngineRunner(cfg)
    runner.start()
    long_prompt = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(2))
    caplog.set_level(logging.INFO, logger="ddserve.engine.scheduler")
    try:

        async def run(prompt, n):
            out = []
            async for step in runner.generate(
                prompt, SamplingParams(max_tokens=n, ignore_eos=True)
            ):
                out += step.token_ids
            return out

        async def main():
            short = asyncio.create_task(run([1, 5, 9], 80))
            await asyncio.sleep(0.05)
            await run(long_prompt.tolist(), 4)
            return await short

        asyncio.run(main())
    finally:
        runner.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == "ddserve.engine.scheduler"]
    parsed = [LINE.match(line) for line in lines]
    assert lines and all(parsed), lines
    assert all(m.group(4) == "4" for m in parsed)
    prompt_tokens = sum(int(m.group(9) or 0) for m in parsed)
    prefilling = sum(int(m.group(7) or 0) for m in parsed)
    # 299 of the long prompt's tokens go in as 16-token chunks (the short prompt's 2 went in
    # before the first line's rounds, or in them); rounds not yet a full interval are unlogged
    assert prefilling >= 10 and 280 <= prompt_tokens <= 301, lines
    assert all(float(m.group(3)) > 0 for m in parsed)
