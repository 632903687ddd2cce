"""From an API request to engine outputs and back: sampling defaults, text, stop strings."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from service.engine.runner import EngineRunner
from service.engine.sampling import RequestStats, SamplingParams
from service.server.text import Detokenizer


@dataclass
class Delta:
    """One streamed piece of a completion; the last one has finish_reason and stats."""

    text: str
    token_ids: list[int]
    fingerprint: str
    finish_reason: str | None = None
    stats: RequestStats | None = None


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    fingerprint: str = ""
    stats: RequestStats | None = None
    latency_s: float = 0.0


def resolve_sampling(
    runner: EngineRunner,
    prompt: list[int],
    *,
    max_tokens,
    temperature,
    top_p,
    top_k,
    stop=(),
    stop_token_ids=(),
    ignore_eos=False,
    seed=None,
) -> SamplingParams:
    """Per-request values over the engine's live defaults; validates the lengths."""
    live = runner.config.params
    return SamplingParams(
        temperature=live.temperature if temperature is None else temperature,
        top_p=live.top_p if top_p is None else top_p,
        top_k=live.top_k if top_k is None or top_k < 0 else top_k,
        max_tokens=runner.check_prompt(prompt, max_tokens),
        stop=tuple(stop),
        stop_token_ids=tuple(stop_token_ids or ()),
        ignore_eos=ignore_eos,
        seed=seed,  # None: a fresh random seed per request
    )


async def stream_deltas(
    runner: EngineRunner, prompt: list[int], sampling: SamplingParams
) -> AsyncIterator[Delta]:
    detok = Detokenizer(runner.tokenizer, sampling.stop)
    async for out in runner.generate(prompt, sampling):
        text = detok.push(out.token_ids)
        if detok.stopped:  # a stop string ended it; leaving the loop cancels the request
            yield Delta(text, out.token_ids, out.fingerprint, "stop", out.stats)
            return
        if out.finished:
            yield Delta(
                text + detok.flush(), out.token_ids, out.fingerprint, out.finish_reason, out.stats
            )
            return
        yield Delta(text, out.token_ids, out.fingerprint)


async def complete(runner: EngineRunner, prompt: list[int], sampling: SamplingParams) -> Completion:
    t0 = time.perf_counter()
    result = Completion()
    async for d in stream_deltas(runner, prompt, sampling):
        result.text += d.text
        result.token_ids.extend(d.token_ids)
        result.fingerprint = d.fingerprint
        if d.finish_reason is not None:
            result.finish_reason, result.stats = d.finish_reason, d.stats
    result.latency_s = time.perf_counter() - t0
    return result
