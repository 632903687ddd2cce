"""OpenAI response bodies (chat.completion, text_completion and their stream chunks), and
their log-probs objects."""

from __future__ import annotations

import json
import time
import uuid

from ddserve.api.generation import TokenLogprob
from ddserve.engine.sampling import RequestStats


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(stats: RequestStats | None) -> dict:
    p = stats.prompt_tokens if stats else 0
    c = stats.completion_tokens if stats else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def ddtree_ext(stats: RequestStats | None) -> dict:
    """Extension field `ddtree`: the request's speculation statistics."""
    if stats is None:
        return {}
    return {
        "verify_rounds": stats.verify_rounds,
        "accept_length": round(stats.tau, 4),
        "draft_ms": round(stats.draft_s * 1e3, 2),
        "verify_ms": round(stats.verify_s * 1e3, 2),
        "prefill_ms": round(stats.prefill_s * 1e3, 2),
    }


def chat_logprobs(entries: list[TokenLogprob] | None, strings) -> dict | None:
    """choices[].logprobs of chat: {content: [{token, logprob, bytes, top_logprobs}]};
    `strings` maps a token id to its (text, bytes) (ddserve.api.text.TokenStrings)."""
    if entries is None:
        return None
    content = []
    for e in entries:
        text, raw = strings(e.token_id)
        top = []
        for tid, lp in e.top:
            t, b = strings(tid)
            top.append({"token": t, "logprob": lp, "bytes": b})
        content.append({"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(entries: list[TokenLogprob] | None, strings) -> dict | None:
    """choices[].logprobs of completions: {tokens, token_logprobs, top_logprobs, text_offset};
    each top_logprobs map holds the N most likely tokens and always the chosen one (so up to
    N + 1 entries, as OpenAI's); text_offset: where each token's text begins in the text."""
    if entries is None:
        return None
    tokens, logprobs, tops, offsets = [], [], [], []
    for e in entries:
        text = strings(e.token_id)[0]
        top = {strings(tid)[0]: lp for tid, lp in e.top}
        top.setdefault(text, e.logprob)
        tokens.append(text)
        logprobs.append(e.logprob)
        tops.append(top)
        offsets.append(e.offset)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_response(
    rid: str,
    model: str,
    text: str,
    finish: str | None,
    fp: str,
    stats: RequestStats | None,
    logprobs: dict | None = None,
) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": fp,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        ],
        "usage": usage(stats),
        "ddtree": ddtree_ext(stats),
    }


def completion_response(
    rid: str,
    model: str,
    choices: list[tuple[str, str | None, dict | None]],
    fp: str,
    stats: RequestStats | None,
) -> dict:
    """choices: (text, finish_reason, logprobs) per prompt, in the request's order; stats: all
    of them."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": fp,
        "choices": [
            {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
            for i, (text, finish, logprobs) in enumerate(choices)
        ],
        "usage": usage(stats),
        "ddtree": ddtree_ext(stats),
    }


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    fp: str,
    delta: dict,
    finish: str | None = None,
    logprobs: dict | None = None,
) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": fp,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
    }


def completion_chunk(
    rid: str,
    model: str,
    created: int,
    fp: str,
    text: str,
    finish: str | None = None,
    index: int = 0,
    logprobs: dict | None = None,
) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": fp,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
    }


def sse(data: dict | str) -> str:
    body = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {body}\n\n"


class StreamEvents:
    """A stream's chunks as server-sent events, as OpenAI sends them under
    `stream_options.include_usage`: every chunk with `"usage": null`, then one with no
    choices and the request's usage (`usage`)."""

    def __init__(self, include_usage: bool):
        self.include_usage = include_usage

    def __call__(self, chunk: dict) -> str:
        if self.include_usage:
            chunk.setdefault("usage", None)
        return sse(chunk)

    def usage(self, chunk: dict, stats: RequestStats | None) -> str:
        return sse({**chunk, "choices": [], "usage": usage(stats)})


def sse_of(stream_options) -> StreamEvents:
    return StreamEvents(bool(stream_options and stream_options.include_usage))
