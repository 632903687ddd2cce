"""A request as the builtin engine's worker sees it (ddserve.engine.runner, .rounds): what it
hands out each round (StepOutput), where outputs go (EngineRequest.deliver: the caller's event
loop here, the engine core's outbox in ddserve.engine.core), and the one health rule of a
one-token generation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ddserve.engine.sampling import Logprobs, RequestStats, SamplingParams
from ddserve.engine.sequence import Sequence
from ddserve.errors import EngineError, EngineUnavailable


@dataclass
class StepOutput:
    token_ids: list[int]  # new tokens of this round
    finished: bool
    finish_reason: str | None
    fingerprint: str
    stats: RequestStats  # the request's statistics so far
    logprobs: Logprobs | None = None  # raw log-probs of token_ids, when the request asks


class EngineRequest:
    """One request as the worker sees it. `deliver` hands a StepOutput or an exception to
    whoever waits for it; subclasses say where (an asyncio queue in this process; the
    engine core's per-round outbox, ddserve.engine.core)."""

    def __init__(self, prompt: list[int], sampling: SamplingParams):
        self.prompt, self.sampling = prompt, sampling
        self.t0 = time.perf_counter()  # received (request phase times: RequestStats)
        self.seq: Sequence | None = None  # made by the worker thread
        self.failed = False
        self.cancelled = False
        self.prefilled = False

    @property
    def finished(self) -> bool:
        return self.failed or (self.seq is not None and self.seq.finished)

    def deliver(self, item: StepOutput | BaseException) -> None:
        raise NotImplementedError


class AsyncRequest(EngineRequest):
    """A request of `EngineRunner.generate`: outputs go to the caller's event loop."""

    def __init__(self, prompt: list[int], sampling: SamplingParams, loop):
        super().__init__(prompt, sampling)
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def deliver(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the client's event loop is gone; nobody is waiting
            self.cancelled = True


async def health_generation(outputs: AsyncIterator, timeout: float, t0: float) -> float:
    """Drain a one-token health generation (any iterator of outputs with `token_ids`) within
    `timeout`; returns seconds since `t0` (time.perf_counter), or raises EngineUnavailable /
    EngineError. The one health rule of the in-process runner and the engine core's client."""

    async def count() -> int:
        n = 0
        async for out in outputs:
            n += len(out.token_ids)
        return n

    try:
        n = await asyncio.wait_for(count(), timeout)
    except TimeoutError as exc:
        raise EngineUnavailable(f"health generation did not finish within {timeout:.0f}s") from exc
    if n < 1:
        raise EngineError("health generation returned no token")
    return time.perf_counter() - t0
