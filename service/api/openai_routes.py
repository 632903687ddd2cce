"""The OpenAI API of an app: GET /v1/models, POST /v1/chat/completions and /v1/completions
(streamed as SSE or not; ddserve.api.openai_format shapes the bodies)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from ddserve.api import openai_format as fmt
from ddserve.api.generation import complete_all, interleave, merged_stats
from ddserve.api.http_errors import ERRORS
from ddserve.api.limits import deadline_of
from ddserve.api.protocol import ChatCompletionRequest, CompletionRequest
from ddserve.api.served import CLIENT_CLOSED, PER_MESSAGE_CHARS, Served, off_loop_if_long
from ddserve.api.text import encode, render_chat
from ddserve.errors import InvalidRequest


@contextmanager
def ids_as_prompt() -> Iterator[None]:
    """The engine names token ids it refuses `input_ids` (/generate's field); a completion's
    ids are its `prompt`."""
    try:
        yield
    except InvalidRequest as exc:
        if exc.param == "input_ids":
            exc.param = "prompt"
        raise


def register(app: FastAPI, s: Served) -> None:
    """The OpenAI routes on `app`, over `s`."""

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": s.model_id,
                    "object": "model",
                    "created": int(s.started_at),
                    "owned_by": "ddserve",
                }
            ],
        }

    @app.post("/v1/chat/completions", dependencies=[Depends(s.admit)], responses=ERRORS)
    async def chat(req: ChatCompletionRequest, request: Request):
        deadline = deadline_of(s.limits)
        s.check_model(req.model)
        messages = [{"role": m.role, "content": m.text} for m in req.messages]
        chars = sum(len(m["content"]) for m in messages)
        s.check_text(chars, "messages", messages=len(messages))
        # the template's work grows with the messages too, not only with their text
        work = chars + PER_MESSAGE_CHARS * len(messages)
        prompt = await off_loop_if_long(work, render_chat, s.backend.tokenizer, messages)
        sp = s.openai_sampling(req, prompt)
        rid = fmt.new_id("chatcmpl")
        if not req.stream:
            c = await s.complete_for(request, prompt, sp, deadline)
            if c is None:
                return Response(status_code=CLIENT_CLOSED)
            s.record(c.stats)
            return fmt.chat_response(
                rid,
                s.model_id,
                c.text,
                c.finish_reason,
                c.fingerprint,
                c.stats,
                fmt.chat_logprobs(c.logprobs, s.strings),
            )
        sse = fmt.sse_of(req.stream_options)

        async def chunks():
            created, sent_role = int(time.time()), False
            async for d in s.stream_of(prompt, sp, deadline, req.stream_interval):
                if not sent_role:
                    yield sse(
                        fmt.chat_chunk(
                            rid,
                            s.model_id,
                            created,
                            d.fingerprint,
                            {"role": "assistant", "content": ""},
                        )
                    )
                    sent_role = True
                if d.text or d.logprobs:
                    lp = fmt.chat_logprobs(d.logprobs, s.strings)
                    delta = {"content": d.text}
                    yield sse(
                        fmt.chat_chunk(rid, s.model_id, created, d.fingerprint, delta, None, lp)
                    )
                if d.finish_reason is not None:
                    s.record(d.stats)
                    last = fmt.chat_chunk(
                        rid, s.model_id, created, d.fingerprint, {}, d.finish_reason
                    )
                    last["ddtree"] = fmt.ddtree_ext(d.stats)
                    yield sse(last)
                    if sse.include_usage:
                        head = fmt.chat_chunk(rid, s.model_id, created, d.fingerprint, {})
                        yield sse.usage(head, d.stats)
            yield fmt.sse("[DONE]")

        return await s.sse_response(chunks())

    @app.post("/v1/completions", dependencies=[Depends(s.admit)], responses=ERRORS)
    async def completions(req: CompletionRequest, request: Request):
        """One choice per prompt (a list of prompts: each its own engine request, all at
        once; streamed interleaved as they come, each chunk with its choice's index)."""
        deadline = deadline_of(s.limits)
        s.check_model(req.model)
        texts = req.prompts
        for text in texts:
            if isinstance(text, str):
                s.check_text(len(text), "prompt")
        if s.limits.max_requests and len(texts) > s.limits.max_requests:
            raise InvalidRequest(
                f"{len(texts)} prompts; this server runs at most {s.limits.max_requests} "
                "generations at once (`ddserve engine --max-requests`)",
                param="prompt",
            )

        def echo_of(t: str | list[int]) -> str:
            """The prompt echoed before its completion (token ids as their text)."""
            if not req.echo or (isinstance(t, list) and s.backend.tokenizer is None):
                return ""
            return t if isinstance(t, str) else s.backend.tokenizer.decode(t)

        def tokenize() -> tuple[list[list[int]], list[str]]:
            ids = [t if isinstance(t, list) else encode(s.backend.tokenizer, t) for t in texts]
            return ids, [echo_of(t) for t in texts]

        # text to encode, and token ids to decode when they are echoed (a token ~ 4 chars)
        work = sum(len(t) if isinstance(t, str) else 4 * len(t) * req.echo for t in texts)
        prompts, echoes = await off_loop_if_long(work, tokenize)
        sps = [s.openai_sampling(req, p, "prompt") for p in prompts]
        rid = fmt.new_id("cmpl")
        extra = len(prompts) - 1  # `admit` counted the first
        s.admission.enter(extra)
        if not req.stream:
            try:
                with ids_as_prompt():
                    done = await s.finish_for(
                        request, complete_all(s.backend, prompts, sps), deadline
                    )
            finally:
                s.admission.leave(extra)
            if done is None:
                return Response(status_code=CLIENT_CLOSED)
            for c in done:
                s.record(c.stats)
            choices = [
                (e + c.text, c.finish_reason, fmt.completion_logprobs(c.logprobs, s.strings))
                for e, c in zip(echoes, done, strict=True)
            ]
            stats = merged_stats([c.stats for c in done])
            return fmt.completion_response(rid, s.model_id, choices, done[0].fingerprint, stats)

        sse = fmt.sse_of(req.stream_options)

        async def chunks():
            created, finished = int(time.time()), []
            streams = [
                s.stream_of(p, sp, deadline, req.stream_interval)
                for p, sp in zip(prompts, sps, strict=True)
            ]
            try:
                with ids_as_prompt():
                    async for i, d in interleave(streams):
                        text = echoes[i] + d.text
                        echoes[i] = ""
                        if not text and not d.logprobs and d.finish_reason is None:
                            continue
                        lp = fmt.completion_logprobs(d.logprobs, s.strings)
                        chunk = fmt.completion_chunk(
                            rid, s.model_id, created, d.fingerprint, text, d.finish_reason, i, lp
                        )
                        if d.finish_reason is not None:
                            s.record(d.stats)
                            finished.append(d.stats)
                            chunk["ddtree"] = fmt.ddtree_ext(d.stats)
                            # the last choice: the request's usage (without include_usage,
                            # on its final chunk: ddserve's own, as before stream_options)
                            if len(finished) == len(prompts) and not sse.include_usage:
                                chunk["usage"] = fmt.usage(merged_stats(finished))
                        yield sse(chunk)
                        if len(finished) == len(prompts) and sse.include_usage:
                            head = fmt.completion_chunk(rid, s.model_id, created, d.fingerprint, "")
                            yield sse.usage(head, merged_stats(finished))
                yield fmt.sse("[DONE]")
            finally:
                s.admission.leave(extra)

        return await s.sse_response(chunks())
