"""From an API request to backend outputs and back: sampling defaults, lengths, results."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TypeVar

from ddserve.api.text import Detokenizer
from ddserve.engine.sampling import Logprobs, RequestStats, SamplingParams
from ddserve.errors import ContextLengthExceeded, EngineError, InvalidRequest


@dataclass
class TokenLogprob:
    """One emitted token's raw log-prob (see ddserve.engine.sampling), the k most likely
    tokens' at its position [(id, log-prob)], best first, and where its text begins in the
    completion's text."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    offset: int


T = TypeVar("T")


@dataclass
class Delta:
    """One streamed piece of a completion; the last one has finish_reason and stats.
    `logprobs` (requests that ask): the tokens whose text became whole in this piece."""

    text: str
    token_ids: list[int]
    fingerprint: str
    finish_reason: str | None = None
    stats: RequestStats | None = None
    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def joined(cls, pieces: list[Delta]) -> Delta:
        """Consecutive pieces as one: their text, tokens and log-probs in order; the last
        one's fingerprint, finish and stats."""
        last = pieces[-1]
        if len(pieces) == 1:
            return last
        lps = [p.logprobs for p in pieces if p.logprobs is not None]
        return cls(
            "".join(p.text for p in pieces),
            [t for p in pieces for t in p.token_ids],
            last.fingerprint,
            last.finish_reason,
            last.stats,
            [e for lp in lps for e in lp] if lps else None,
        )


async def every_n_tokens(stream: AsyncIterator[Delta], n: int) -> AsyncIterator[Delta]:
    """SGLang's and vLLM's --stream-interval: the first piece with something to show (text,
    log-probs or a finish) at once, so time to first token is untouched; then the pieces
    joined until they hold `n` tokens; the last one (its finish_reason) at once. An error
    from `stream` (the engine's, the deadline's) comes after the pieces held so far, as with
    n = 1. Fewer, larger stream chunks: the API process's work per token (JSON, the HTTP
    write, Ray's proxy) falls about n-fold; a client sees text in steps of about n tokens.
    Closing this closes `stream` (the generation is cancelled)."""
    async with contextlib.aclosing(stream):
        held: list[Delta] = []
        count, shown = 0, False
        try:
            async for d in stream:
                held.append(d)
                count += len(d.token_ids)
                if (
                    d.finish_reason is not None
                    or count >= n
                    or (not shown and (d.text or d.logprobs))
                ):
                    shown = True
                    yield Delta.joined(held)
                    held, count = [], 0
        except Exception:
            if held:
                yield Delta.joined(held)
            raise
        if held:  # a stream that ended without a finish
            yield Delta.joined(held)


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    fingerprint: str = ""
    stats: RequestStats | None = None
    latency_s: float = 0.0
    logprobs: list[TokenLogprob] | None = None


class TextStream:
    """A request's output as the API returns it: text through the Detokenizer (stop strings,
    whole characters) and, for requests that ask, log-probs released with the text.

    The rule for log-probs: a token's entry is returned once its text lies wholly within the
    text returned (never earlier, so streamed and whole answers list the same tokens). A
    stop string cuts the text; the token that straddles its start and every later one are
    not returned (their text was not), so the entries' texts joined are a prefix of the text.
    A token with no text of its own (EOS) has its entry once the text before it is out."""

    def __init__(self, tokenizer, sampling: SamplingParams):
        self.want = sampling.logprobs is not None
        self.detok = Detokenizer(tokenizer, sampling.stop, per_token=self.want)
        self.ids: list[int] = []
        self.pending = Logprobs()  # entries of ids[released:], from the engine
        self.released = 0

    @property
    def stopped(self) -> bool:
        return self.detok.stopped

    def push(self, ids: list[int], logprobs: Logprobs | None) -> str:
        if self.want:
            if logprobs is None or len(logprobs) != len(ids):
                raise EngineError("the engine returned no log-probs for a request that asks")
            self.ids += ids
            self.pending.extend(logprobs)
        return self.detok.push(ids) if ids else ""

    def flush(self) -> str:
        return self.detok.flush()

    def take(self) -> list[TokenLogprob] | None:
        """Entries whose text is out by now (None when the request did not ask)."""
        if not self.want:
            return None
        n = self.detok.complete - self.released
        out = []
        for j in range(n):
            i = self.released + j
            p = self.pending
            top = list(zip(p.top_ids[j], p.top_logprobs[j], strict=True))
            out.append(TokenLogprob(self.ids[i], p.chosen[j], top, self.detok.start(i)))
        self.pending = self.pending.slice(n)
        self.released += n
        return out


def check_prompt(
    prompt: list[int],
    max_tokens: int | None,
    max_context: int,
    param: str = "messages",
    max_tokens_param: str = "max_tokens",
) -> int:
    """Validate lengths against the context; return the effective max_tokens. `param`
    names the prompt's field in the request (messages, prompt, text, input_ids),
    `max_tokens_param` the completion length's (/generate: sampling_params.max_new_tokens)."""
    if not prompt:
        raise InvalidRequest("the prompt is empty", param=param)
    room = max_context - len(prompt)
    if room <= 0:
        raise ContextLengthExceeded(
            f"the prompt has {len(prompt)} tokens; this model's maximum context length is {max_context} tokens",
            param=param,
        )
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise ContextLengthExceeded(
            f"{max_tokens_param.rsplit('.', 1)[-1]}={max_tokens} plus the prompt's {len(prompt)} tokens exceeds the maximum context length of {max_context} tokens; ask for at most {room}",
            param=max_tokens_param,
        )
    return max_tokens


def resolve_sampling(
    backend,
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
    logprobs=None,
    logit_bias=(),
    prompt_param="messages",
    max_tokens_param="max_tokens",
) -> SamplingParams:
    """Per-request values over the backend's live defaults; validates the lengths (a prompt
    too long is named as the request's `prompt_param`, a length past the context as its
    `max_tokens_param`)."""
    live = backend.params
    return SamplingParams(
        temperature=live.temperature if temperature is None else temperature,
        top_p=live.top_p if top_p is None else top_p,
        top_k=live.top_k if top_k is None or top_k < 0 else top_k,
        max_tokens=check_prompt(
            prompt, max_tokens, backend.max_context, prompt_param, max_tokens_param
        ),
        stop=tuple(stop),
        stop_token_ids=tuple(stop_token_ids or ()),
        ignore_eos=ignore_eos,
        seed=seed,  # None: a fresh random seed per request
        logprobs=logprobs,
        logit_bias=tuple(logit_bias),
    )


async def complete(backend, prompt: list[int], sampling: SamplingParams) -> Completion:
    t0 = time.perf_counter()
    result = Completion(logprobs=[] if sampling.logprobs is not None else None)
    async for d in backend.stream(prompt, sampling):
        result.text += d.text
        result.token_ids.extend(d.token_ids)
        if d.logprobs and result.logprobs is not None:
            result.logprobs += d.logprobs
        result.fingerprint = d.fingerprint
        if d.finish_reason is not None:
            result.finish_reason, result.stats = d.finish_reason, d.stats
    result.latency_s = time.perf_counter() - t0
    return result


def accept_histogram(stats: RequestStats | None) -> dict[str, int]:
    """{tokens committed in a round: rounds} of one request (per-round acceptance lengths)."""
    return {str(k): v for k, v in sorted(Counter(stats.accept_lengths).items())} if stats else {}


async def complete_all(backend, prompts: list[list[int]], samplings: list) -> list[Completion]:
    """Every prompt as its own engine request, all at once (one task each); the first failure
    cancels the others and is raised. Cancelling this cancels every request."""
    tasks = [
        asyncio.ensure_future(complete(backend, p, sp))
        for p, sp in zip(prompts, samplings, strict=True)
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def interleave(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(index of its stream, item) for the items of several streams, in the order they come
    (as vLLM streams a list of prompts). Each stream is pumped by a task of its own, so every
    one is its own engine request, all at once; the first error cancels the others and is
    raised; a consumer that stops early cancels them all."""
    queue: asyncio.Queue = asyncio.Queue()
    ended = object()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        async with contextlib.aclosing(stream):
            async for item in stream:
                queue.put_nowait((i, item))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    for t in tasks:
        t.add_done_callback(lambda t: queue.put_nowait((ended, t)))
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if i is ended:
                live -= 1
                if not item.cancelled() and item.exception() is not None:
                    raise item.exception()
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def merged_stats(stats: list[RequestStats | None]) -> RequestStats:
    """The statistics of several requests together (one response's usage and `ddtree`)."""
    total = RequestStats()
    for s in stats:
        if s is None:
            continue
        total.prompt_tokens += s.prompt_tokens
        total.completion_tokens += s.completion_tokens
        total.verify_rounds += s.verify_rounds
        total.draft_s += s.draft_s
        total.verify_s += s.verify_s
        total.prefill_s += s.prefill_s
        total.accept_lengths.extend(s.accept_lengths)
    return total
