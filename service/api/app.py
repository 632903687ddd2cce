"""The engine server: one builtin engine behind HTTP.

  POST /generate              native (SGLang-style) generation: text or input_ids
  POST /v1/chat/completions   OpenAI chat (stream via SSE, or not)
  POST /v1/completions        OpenAI completions
  GET  /v1/models             the served model
  GET  /health                a real one-token generation (SGLang's /health_generate)
  GET  /server_info           effective config, fingerprint, load, totals
  POST /admin/params          change live parameters; answers once they are in force
  GET  /metrics               Prometheus metrics (ddserve.api.observability), when this app
                              meters its own backend (the engine server; not a Ray replica)

Errors: `ddserve.errors.openai_error_body` is the only mapping to HTTP. Before a stream's
first chunk an error is an HTTP status; after it, an `error` event in the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import time
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException

from ddserve.api import openai_format as fmt
from ddserve.api.auth import ApiKeyAuth
from ddserve.api.backend import Backend
from ddserve.api.generation import (
    accept_histogram,
    complete,
    complete_all,
    interleave,
    merged_stats,
    resolve_sampling,
)
from ddserve.api.http_errors import ERRORS, error_response, http_error, validation_message
from ddserve.api.limits import (
    Admission,
    BodySizeLimit,
    ServerLimits,
    deadline_of,
    deadline_stream,
    guarded,
)
from ddserve.api.observability import (
    AccessLog,
    MeteredBackend,
    PrometheusExporter,
    StatsLog,
    drafter_depth,
    engine_load,
)
from ddserve.api.protocol import (
    AdminParams,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    Sampling,
)
from ddserve.api.text import TokenStrings, encode, longest_token_chars, render_chat
from ddserve.errors import (
    ClientDisconnected,
    ConfigError,
    Conflict,
    ContextLengthExceeded,
    DDServeError,
    EngineUnavailable,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    Unauthorized,
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


def freeze_startup_heap() -> None:
    """Move everything start-up allocated (the app, the tokenizer, imported modules) out of
    the garbage collector's sight, so collections during a burst of requests walk only the
    requests' own objects (vLLM's and SGLang's API servers do the same)."""
    gc.collect()
    gc.freeze()


async def off_loop_if_long(chars: int, fn, *args):
    """fn(*args), in a worker thread when its work, in characters of text, is over
    INLINE_CHARS."""
    if chars <= INLINE_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def create_app(
    backend: Backend,
    *,
    admin_token: str | None = None,
    title: str = "ddserve engine",
    admin_enabled: bool = True,
    limits: ServerLimits | None = None,
    access_log: bool | None = None,
    stats_interval_s: float | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The OpenAI API over any backend (ddserve.api.backend.Backend: the contract), under
    `limits` (ddserve.api.limits: body size, deadline, admission); with `api_key`, /v1/* and
    /generate need it as a Bearer token (ddserve.api.auth).

    A backend that is not metered yet gets a `MeteredBackend` with a Prometheus exporter,
    served at GET /metrics (the engine server); a `MeteredBackend` passed in keeps its own
    exporter (a Ray replica: Ray's metrics agent exports it). `access_log` (default: env
    DDSERVE_ACCESS_LOG=1) logs one line per HTTP request; a stats line is logged every
    `stats_interval_s` while there is work (default: env DDSERVE_STATS_INTERVAL or 10; 0 = off)."""
    limits = limits or ServerLimits()
    if access_log is None:
        access_log = os.environ.get("DDSERVE_ACCESS_LOG", "").lower() in ("1", "true", "yes", "on")
    if stats_interval_s is None:
        stats_interval_s = float(os.environ.get("DDSERVE_STATS_INTERVAL") or 10.0)
    exporter = None
    if not isinstance(backend, MeteredBackend):
        exporter = PrometheusExporter(backend.model_id)
        backend = MeteredBackend(
            backend,
            exporter,
            drafter_depth=drafter_depth(backend.info().get("config", {}).get("drafter", {})),
            load=engine_load(backend),
            record_reconfig=True,
        )
    stats = StatsLog(backend, stats_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        task = asyncio.create_task(stats.run()) if stats_interval_s > 0 else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()

    app = FastAPI(title=title, docs_url=None, redoc_url=None, lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyAuth, api_key=api_key)  # outside the body limit: 401 first
    if access_log:
        app.add_middleware(AccessLog)  # outermost: sees every answer, 401s and 413s included
    started_at = time.time()
    model_id = backend.model_id
    totals = {
        "requests": 0,
        "errors": 0,
        "completion_tokens": 0,
        "verify_rounds": 0,
        "refused_busy": 0,
        "client_disconnects": 0,
    }
    admission = Admission(limits.max_requests, limits.retry_after_s)
    longest_token = longest_token_chars(backend.tokenizer)
    strings = TokenStrings(backend.tokenizer)  # token id -> (text, bytes) for log-probs

    @app.exception_handler(DDServeError)
    async def _ddserve_error(_: Request, exc: DDServeError):
        if exc.status_code >= 500:
            totals["errors"] += 1
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        msg, param = validation_message(exc)
        return error_response(InvalidRequest(msg, param=param))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return http_error(request, exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        totals["errors"] += 1
        return error_response(exc)

    async def admit(request: Request):
        """A dependency of the generation endpoints: one admission for the whole request,
        its stream included."""
        try:
            admission.enter()
        except Overloaded:
            totals["refused_busy"] += 1
            raise
        try:
            yield
        finally:
            admission.leave()

    def check_text(chars: int, param: str) -> None:
        """Refuse a text that surely has more tokens than the context before tokenising it:
        tokenisation work stays bounded by the context, not by the body size."""
        if longest_token and chars > backend.max_context * longest_token:
            raise ContextLengthExceeded(
                f"the prompt has {chars} characters, so at least {chars // longest_token} tokens "
                f"(a token covers at most {longest_token}); this model's maximum context length "
                f"is {backend.max_context} tokens",
                param=param,
            )

    def check_model(name: str) -> None:
        if name != model_id:
            raise ModelNotFound(
                f"model {name!r} is not served here; this server serves {model_id!r}", param="model"
            )

    def openai_sampling(req: Sampling, prompt: list[int]):
        return resolve_sampling(
            backend,
            prompt,
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

    def record(stats) -> None:
        totals["requests"] += 1
        if stats is not None:
            totals["completion_tokens"] += stats.completion_tokens
            totals["verify_rounds"] += stats.verify_rounds

    async def first_then_rest(stream: AsyncIterator[str]) -> AsyncIterator[str]:
        """Pull the first chunk before the response starts, so early errors are HTTP errors."""
        first = await stream.__anext__()

        async def rest():
            yield first
            try:
                async for chunk in stream:
                    yield chunk
            except DDServeError as exc:
                totals["errors"] += 1
                yield fmt.sse(openai_error_body(exc)[1])
                yield fmt.sse("[DONE]")

        return rest()

    async def complete_for(request: Request, prompt: list[int], sp, deadline):
        """The whole completion, or None when the client left (its generation cancelled)."""
        return await finish_for(request, complete(backend, prompt, sp), deadline)

    async def finish_for(request: Request, work, deadline):
        """`work` (generations) awaited, or None when the client left (it is cancelled)."""
        try:
            return await guarded(request, work, deadline)
        except ClientDisconnected:
            totals["client_disconnects"] += 1
            log.info("client of %s left; its generation was cancelled", request.url.path)
            return None

    def stream_of(prompt: list[int], sp, deadline):
        return deadline_stream(backend.stream(prompt, sp), deadline)

    async def sse_response(stream: AsyncIterator[str]) -> StreamingResponse:
        body = await first_then_rest(stream)
        return StreamingResponse(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    # -- OpenAI API -------------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_id,
                    "object": "model",
                    "created": int(started_at),
                    "owned_by": "ddserve",
                }
            ],
        }

    @app.post("/v1/chat/completions", dependencies=[Depends(admit)], responses=ERRORS)
    async def chat(req: ChatCompletionRequest, request: Request):
        deadline = deadline_of(limits)
        check_model(req.model)
        messages = [{"role": m.role, "content": m.text} for m in req.messages]
        chars = sum(len(m["content"]) for m in messages)
        check_text(chars, "messages")
        # the template's work grows with the messages too, not only with their text
        work = chars + PER_MESSAGE_CHARS * len(messages)
        prompt = await off_loop_if_long(work, render_chat, backend.tokenizer, messages)
        sp = openai_sampling(req, prompt)
        rid = fmt.new_id("chatcmpl")
        if not req.stream:
            c = await complete_for(request, prompt, sp, deadline)
            if c is None:
                return Response(status_code=CLIENT_CLOSED)
            record(c.stats)
            return fmt.chat_response(
                rid,
                model_id,
                c.text,
                c.finish_reason,
                c.fingerprint,
                c.stats,
                fmt.chat_logprobs(c.logprobs, strings),
            )
        include_usage = bool((req.stream_options or {}).get("include_usage"))

        async def chunks():
            created, sent_role = int(time.time()), False
            async for d in stream_of(prompt, sp, deadline):
                if not sent_role:
                    yield fmt.sse(
                        fmt.chat_chunk(
                            rid,
                            model_id,
                            created,
                            d.fingerprint,
                            {"role": "assistant", "content": ""},
                        )
                    )
                    sent_role = True
                if d.text or d.logprobs:
                    lp = fmt.chat_logprobs(d.logprobs, strings)
                    delta = {"content": d.text}
                    yield fmt.sse(
                        fmt.chat_chunk(rid, model_id, created, d.fingerprint, delta, None, lp)
                    )
                if d.finish_reason is not None:
                    record(d.stats)
                    last = fmt.chat_chunk(
                        rid, model_id, created, d.fingerprint, {}, d.finish_reason
                    )
                    last["ddtree"] = fmt.ddtree_ext(d.stats)
                    yield fmt.sse(last)
                    if include_usage:
                        yield fmt.sse(
                            {
                                **fmt.chat_chunk(rid, model_id, created, d.fingerprint, {}),
                                "choices": [],
                                "usage": fmt.usage(d.stats),
                            }
                        )
            yield fmt.sse("[DONE]")

        return await sse_response(chunks())

    @app.post("/v1/completions", dependencies=[Depends(admit)], responses=ERRORS)
    async def completions(req: CompletionRequest, request: Request):
        """One choice per prompt (a list of prompts: each its own engine request, all at
        once; streamed interleaved as they come, each chunk with its choice's index)."""
        deadline = deadline_of(limits)
        check_model(req.model)
        texts = req.prompts
        for text in texts:
            if isinstance(text, str):
                check_text(len(text), "prompt")
        if limits.max_requests and len(texts) > limits.max_requests:
            raise InvalidRequest(
                f"{len(texts)} prompts; this server runs at most {limits.max_requests} "
                "generations at once (`ddserve engine --max-requests`)",
                param="prompt",
            )

        def echo_of(t: str | list[int]) -> str:
            """The prompt echoed before its completion (token ids as their text)."""
            if not req.echo or (isinstance(t, list) and backend.tokenizer is None):
                return ""
            return t if isinstance(t, str) else backend.tokenizer.decode(t)

        def tokenize() -> tuple[list[list[int]], list[str]]:
            ids = [t if isinstance(t, list) else encode(backend.tokenizer, t) for t in texts]
            return ids, [echo_of(t) for t in texts]

        # text to encode, and token ids to decode when they are echoed (a token ~ 4 chars)
        work = sum(len(t) if isinstance(t, str) else 4 * len(t) * req.echo for t in texts)
        prompts, echoes = await off_loop_if_long(work, tokenize)
        sps = [openai_sampling(req, p) for p in prompts]
        rid = fmt.new_id("cmpl")
        extra = len(prompts) - 1  # `admit` counted the first
        admission.enter(extra)
        if not req.stream:
            try:
                done = await finish_for(request, complete_all(backend, prompts, sps), deadline)
            finally:
                admission.leave(extra)
            if done is None:
                return Response(status_code=CLIENT_CLOSED)
            for c in done:
                record(c.stats)
            choices = [
                (e + c.text, c.finish_reason, fmt.completion_logprobs(c.logprobs, strings))
                for e, c in zip(echoes, done, strict=True)
            ]
            stats = merged_stats([c.stats for c in done])
            return fmt.completion_response(rid, model_id, choices, done[0].fingerprint, stats)

        async def chunks():
            created, finished = int(time.time()), []
            streams = [stream_of(p, sp, deadline) for p, sp in zip(prompts, sps, strict=True)]
            try:
                async for i, d in interleave(streams):
                    text = echoes[i] + d.text
                    echoes[i] = ""
                    if not text and not d.logprobs and d.finish_reason is None:
                        continue
                    lp = fmt.completion_logprobs(d.logprobs, strings)
                    chunk = fmt.completion_chunk(
                        rid, model_id, created, d.fingerprint, text, d.finish_reason, i, lp
                    )
                    if d.finish_reason is not None:
                        record(d.stats)
                        finished.append(d.stats)
                        chunk["ddtree"] = fmt.ddtree_ext(d.stats)
                        if len(finished) == len(prompts):  # the last choice: the request's usage
                            chunk["usage"] = fmt.usage(merged_stats(finished))
                    yield fmt.sse(chunk)
                yield fmt.sse("[DONE]")
            finally:
                admission.leave(extra)

        return await sse_response(chunks())

    # -- native generate (SGLang-compatible subset) -------------------------------------
    @app.post("/generate", dependencies=[Depends(admit)], responses=ERRORS)
    async def generate(req: GenerateRequest, request: Request):
        deadline = deadline_of(limits)
        p = req.sampling_params
        if req.text is not None:
            check_text(len(req.text), "text")
        prompt = (
            req.input_ids
            if req.input_ids is not None
            else await off_loop_if_long(len(req.text), encode, backend.tokenizer, req.text)
        )
        stops = (p.stop,) if isinstance(p.stop, str) else tuple(p.stop or ())
        sp = resolve_sampling(
            backend,
            prompt,
            max_tokens=p.max_new_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            stop=stops,
            stop_token_ids=p.stop_token_ids,
            ignore_eos=p.ignore_eos,
            seed=p.seed,
        )
        t0 = time.perf_counter()

        def meta(stats, finish, fp) -> dict:
            return {
                "prompt_tokens": len(prompt),
                "completion_tokens": stats.completion_tokens if stats else 0,
                "finish_reason": {"type": finish} if finish else None,
                "spec_verify_ct": stats.verify_rounds if stats else 0,
                "spec_accept_length": round(stats.tau, 4) if stats else 0.0,
                # ddserve extensions (SGLang has none of these)
                "ddtree": fmt.ddtree_ext(stats),
                "e2e_latency": round(time.perf_counter() - t0, 4),
                "system_fingerprint": fp,
                **({"spec_accept_histogram": accept_histogram(stats)} if finish and stats else {}),
            }

        if not req.stream:
            c = await complete_for(request, prompt, sp, deadline)
            if c is None:
                return Response(status_code=CLIENT_CLOSED)
            record(c.stats)
            return {
                "text": c.text,
                "output_ids": c.token_ids,
                "meta_info": meta(c.stats, c.finish_reason, c.fingerprint),
                "system_fingerprint": c.fingerprint,
            }

        async def chunks():
            text, ids = "", []
            async for d in stream_of(prompt, sp, deadline):
                text, ids = text + d.text, ids + d.token_ids
                if d.finish_reason is not None:
                    record(d.stats)
                yield fmt.sse(
                    {
                        "text": text,
                        "output_ids": ids,
                        "meta_info": meta(d.stats, d.finish_reason, d.fingerprint),
                        "system_fingerprint": d.fingerprint,
                    }
                )
            yield fmt.sse("[DONE]")

        return await sse_response(chunks())

    # -- operations ---------------------------------------------------------------------
    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        try:
            latency = await backend.check_health()
        except DDServeError as exc:
            return error_response(exc if exc.status_code >= 500 else EngineUnavailable(exc.message))
        return {
            "status": "ok",
            "system_fingerprint": backend.fingerprint,
            "latency_ms": round(latency * 1e3, 2),
        }

    if exporter is not None:

        @app.get("/metrics", include_in_schema=False)
        async def metrics():
            backend.refresh_gauges()
            body, content_type = exporter.render()
            return Response(body, media_type=content_type)

    @app.get("/server_info")
    async def server_info():
        return {
            **backend.info(),
            "totals": dict(totals),
            "uptime_s": round(time.time() - started_at, 1),
            "admin_protected": admin_token is not None,
            "api_key_required": api_key is not None,
            "in_flight": admission.active,
        }

    def admin_guard(request: Request) -> None:
        if not admin_enabled:
            raise Conflict(
                "this is one replica of many: change parameters with `ddserve reconfig set`, which rolls them out to every replica and verifies each"
            )
        if (
            admin_token is not None
            and request.headers.get("authorization") != f"Bearer {admin_token}"
        ):
            raise Unauthorized(
                "changing live parameters needs the admin token (Authorization: Bearer ...)"
            )

    @app.post("/admin/params", dependencies=[Depends(admin_guard)], responses=ERRORS)
    async def admin_params(body: AdminParams):
        changes = body.model_dump(exclude_unset=True)
        if not changes:
            raise InvalidRequest(
                'send a JSON object of live parameters to change, e.g. {"budget": 16}'
            )
        try:
            result = await backend.update_params(changes)
        except ConfigError as exc:
            raise InvalidRequest(exc.message, param=exc.param) from exc
        return result

    return app
