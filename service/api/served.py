"""What the routes of one app share (ddserve.api.app builds it, the route modules register
on it): the backend (metered), the server's limits and admission, the counters /server_info
reports, and the steps every generation endpoint takes — model and size checks, sampling
from an OpenAI request, completing or streaming under the deadline, SSE with errors before
the first chunk as HTTP statuses and after it as error events."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from ddserve.api import openai_format as fmt
from ddserve.api.backend import Backend
from ddserve.api.generation import complete, every_n_tokens, resolve_sampling
from ddserve.api.limits import Admission, ServerLimits, deadline_stream, guarded
from ddserve.api.pieces import parallel
from ddserve.api.protocol import Sampling
from ddserve.api.text import TokenStrings, longest_token_chars
from ddserve.errors import (
    ClientDisconnected,
    ContextLengthExceeded,
    DDServeError,
    ModelNotFound,
    Overloaded,
    openai_error_body,
)

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the log does
# prompts up to this many characters are templated and tokenised on the event loop (~0.15 ms
# for a short chat on a slow core); a thread hop costs more than that, and at a burst of
# arrivals the worker threads fight the loop for the GIL. Longer ones go to a thread, so a
# huge prompt never stalls other clients.
INLINE_CHARS = 2048
PER_MESSAGE_CHARS = 64  # a chat message's share of the template's work, in characters


async def off_loop_if_long(chars: int, fn, *args):
    """fn(*args), in a worker thread when its work, in characters of text, is over
    INLINE_CHARS."""
    if chars <= INLINE_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


class Served:
    """One app's shared state and the steps its generation endpoints take."""

    def __init__(self, backend: Backend, limits: ServerLimits, stream_interval: int = 1):
        self.backend, self.limits = backend, limits
        self.stream_interval = stream_interval  # tokens per stream chunk (after the first)
        self.model_id = backend.model_id
        self.started_at = time.time()
        self.totals = {
            "requests": 0,
            "errors": 0,
            "completion_tokens": 0,
            "verify_rounds": 0,
            "refused_busy": 0,
            "client_disconnects": 0,
        }
        self.admission = Admission(limits.max_requests, limits.retry_after_s)
        self.longest_token = longest_token_chars(backend.tokenizer)
        # long prompts in parallel pieces: decided at load, and said (it is most of a long
        # prompt's time before the engine where it cannot be done)
        if backend.tokenizer is not None:
            if pieces := parallel(backend.tokenizer):
                log.info("long prompts are tokenised in up to %d parallel pieces", pieces)
            else:
                log.info(
                    "prompts are tokenised whole (this tokenizer is not known to split exactly)"
                )
        self.strings = TokenStrings(backend.tokenizer)  # token id -> (text, bytes), log-probs

    async def admit(self):
        """A dependency of the generation endpoints: one admission for the whole request,
        its stream included."""
        try:
            self.admission.enter()
        except Overloaded:
            self.totals["refused_busy"] += 1
            raise
        try:
            yield
        finally:
            self.admission.leave()

    def check_text(self, chars: int, param: str, messages: int = 0) -> None:
        """Refuse a text that surely has more tokens than the context before tokenising it:
        tokenisation work stays bounded by the context, not by the body size. A chat's
        template marks every message with a token at least, so more `messages` than the
        context has tokens are refused too, whatever their text."""
        if messages > self.backend.max_context:
            raise ContextLengthExceeded(
                f"the conversation has {messages} messages, so at least as many tokens; this "
                f"model's maximum context length is {self.backend.max_context} tokens",
                param=param,
            )
        if self.longest_token and chars > self.backend.max_context * self.longest_token:
            raise ContextLengthExceeded(
                f"the prompt has {chars} characters, so at least {chars // self.longest_token} tokens "
                f"(a token covers at most {self.longest_token}); this model's maximum context length "
                f"is {self.backend.max_context} tokens",
                param=param,
            )

    def check_model(self, name: str) -> None:
        if name != self.model_id:
            raise ModelNotFound(
                f"model {name!r} is not served here; this server serves {self.model_id!r}",
                param="model",
            )

    def openai_sampling(self, req: Sampling, prompt: list[int], param: str = "messages"):
        return resolve_sampling(
            self.backend,
            prompt,
            prompt_param=param,
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop=req.stop_list,
            ignore_eos=req.ignore_eos,
            seed=req.seed,
            logprobs=req.num_logprobs,
            logit_bias=req.bias_pairs,
        )

    def record(self, stats) -> None:
        self.totals["requests"] += 1
        if stats is not None:
            self.totals["completion_tokens"] += stats.completion_tokens
            self.totals["verify_rounds"] += stats.verify_rounds

    async def first_then_rest(self, stream: AsyncIterator[str]) -> AsyncIterator[str]:
        """Pull the first chunk before the response starts, so early errors are HTTP errors."""
        first = await stream.__anext__()

        async def rest():
            yield first
            try:
                async for chunk in stream:
                    yield chunk
            except DDServeError as exc:
                self.totals["errors"] += 1
                yield fmt.sse(openai_error_body(exc)[1])
                yield fmt.sse("[DONE]")

        return rest()

    async def complete_for(self, request: Request, prompt: list[int], sp, deadline):
        """The whole completion, or None when the client left (its generation cancelled)."""
        return await self.finish_for(request, complete(self.backend, prompt, sp), deadline)

    async def finish_for(self, request: Request, work, deadline):
        """`work` (generations) awaited, or None when the client left (it is cancelled)."""
        try:
            return await guarded(request, work, deadline)
        except ClientDisconnected:
            self.totals["client_disconnects"] += 1
            log.info("client of %s left; its generation was cancelled", request.url.path)
            return None

    def stream_of(self, prompt: list[int], sp, deadline, interval: int | None = None):
        """The engine's outputs under the deadline, a chunk per `interval` tokens (a
        request's own stream_interval: at least the server's)."""
        # the deadline bounds the wait for each engine output; a chunk holding several
        # outputs is sent before its error when one comes
        stream = deadline_stream(self.backend.stream(prompt, sp), deadline)
        n = max(self.stream_interval, interval or 1)
        if n > 1:
            stream = every_n_tokens(stream, n)
        return stream

    async def sse_response(self, stream: AsyncIterator[str]) -> StreamingResponse:
        body = await self.first_then_rest(stream)
        return StreamingResponse(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
