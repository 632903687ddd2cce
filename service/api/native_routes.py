"""The native generation endpoint of an app: POST /generate, SGLang-style (text or
input_ids, sampling_params, meta_info with spec_verify_ct and spec_accept_length)."""

from __future__ import annotations

import time

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from ddserve.api import openai_format as fmt
from ddserve.api.generation import accept_histogram, resolve_sampling
from ddserve.api.http_errors import ERRORS
from ddserve.api.limits import deadline_of
from ddserve.api.protocol import GenerateRequest
from ddserve.api.served import CLIENT_CLOSED, Served, off_loop_if_long
from ddserve.api.text import encode


def register(app: FastAPI, s: Served) -> None:
    """POST /generate on `app`, over `s`."""

    @app.post("/generate", dependencies=[Depends(s.admit)], responses=ERRORS)
    async def generate(req: GenerateRequest, request: Request):
        deadline = deadline_of(s.limits)
        p = req.sampling_params
        if req.text is not None:
            s.check_text(len(req.text), "text")
        prompt = (
            req.input_ids
            if req.input_ids is not None
            else await off_loop_if_long(len(req.text), encode, s.backend.tokenizer, req.text)
        )
        stops = (p.stop,) if isinstance(p.stop, str) else tuple(p.stop or ())
        sp = resolve_sampling(
            s.backend,
            prompt,
            max_tokens=p.max_new_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            stop=stops,
            stop_token_ids=p.stop_token_ids,
            ignore_eos=p.ignore_eos,
            seed=p.seed,
            prompt_param="text" if req.text is not None else "input_ids",
            max_tokens_param="sampling_params.max_new_tokens",
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
            c = await s.complete_for(request, prompt, sp, deadline)
            if c is None:
                return Response(status_code=CLIENT_CLOSED)
            s.record(c.stats)
            return {
                "text": c.text,
                "output_ids": c.token_ids,
                "meta_info": meta(c.stats, c.finish_reason, c.fingerprint),
                "system_fingerprint": c.fingerprint,
            }

        async def chunks():
            text, ids = "", []
            async for d in s.stream_of(prompt, sp, deadline, p.stream_interval):
                text, ids = text + d.text, ids + d.token_ids
                if d.finish_reason is not None:
                    s.record(d.stats)
                yield fmt.sse(
                    {
                        "text": text,
                        "output_ids": ids,
                        "meta_info": meta(d.stats, d.finish_reason, d.fingerprint),
                        "system_fingerprint": d.fingerprint,
                    }
                )
            yield fmt.sse("[DONE]")

        return await s.sse_response(chunks())
