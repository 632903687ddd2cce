"""--stream-interval (SGLang's and vLLM's flag): the first token at once, then a stream chunk
per N tokens, the last at once; the text, tokens and log-probs are those of the unbuffered
stream, and closing the stream cancels the generation."""

import asyncio
import json
import math

import httpx
import openai
import pytest

from ddserve.api.generation import Delta, TokenLogprob, every_n_tokens
from ddserve.errors import EngineError
from tests.api.conftest import HF_KEY


def piece(i: int, n: int = 1, finish: str | None = None) -> Delta:
    ids = list(range(i, i + n))
    lps = [TokenLogprob(t, -0.5, [], 0) for t in ids]
    return Delta("".join(f"<{t}>" for t in ids), ids, f"fp{i}", finish, None, lps)


def collect(pieces: list[Delta], n: int) -> list[Delta]:
    async def source():
        for p in pieces:
            yield p

    async def run():
        return [d async for d in every_n_tokens(source(), n)]

    return asyncio.run(run())


def test_first_at_once_then_every_n_tokens_then_the_last_at_once():
    pieces = [piece(0), piece(1), piece(2, 2), piece(4), piece(5), piece(6), piece(7, 1, "length")]
    out = collect(pieces, 3)
    assert [d.token_ids for d in out] == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert "".join(d.text for d in out) == "".join(p.text for p in pieces)
    assert [e.token_id for d in out for e in d.logprobs] == list(range(8))
    assert out[-1].finish_reason == "length" and out[-1].fingerprint == "fp7"
    assert [d.finish_reason for d in out[:-1]] == [None] * 3
    # a finish held with fewer than n tokens goes out with them, at once
    out = collect([piece(0), piece(1), piece(2, 1, "stop")], 4)
    assert [d.token_ids for d in out] == [[0], [1, 2]] and out[-1].finish_reason == "stop"
    # n=1 or pieces of n tokens or more: nothing merged
    assert len(collect(pieces, 1)) == len(pieces)
    assert [d.token_ids for d in collect([piece(0, 2), piece(2, 5)], 3)] == [
        [0, 1],
        [2, 3, 4, 5, 6],
    ]


def test_an_error_comes_after_the_pieces_held():
    async def source():
        for i in range(3):
            yield piece(i)
        raise EngineError("engine failure: boom")

    async def run():
        got = []
        with pytest.raises(EngineError):
            async for d in every_n_tokens(source(), 4):
                got.append(d.token_ids)
        return got

    assert asyncio.run(run()) == [[0], [1, 2]]


def test_the_first_text_goes_out_at_once_even_after_empty_pieces():
    """A first piece with no text yet (a held-back stop-string prefix, half a UTF-8
    character) does not use up the piece sent at once."""
    pieces = [Delta("", [1], "f"), Delta("x", [2], "f"), Delta("y", [3], "f")]
    pieces += [Delta("z", [4], "f"), Delta("w", [5], "f", "stop")]
    out = collect(pieces, 4)
    assert [(d.text, d.token_ids) for d in out] == [("x", [1, 2]), ("yzw", [3, 4, 5])]


def test_pieces_without_logprobs_stay_without():
    out = collect([Delta("a", [1], "f"), Delta("b", [2], "f"), Delta("c", [3], "f", "stop")], 2)
    assert [(d.text, d.logprobs) for d in out] == [("a", None), ("bc", None)]


def test_closing_the_stream_closes_the_generation():
    closed = []

    async def source():
        try:
            for i in range(100):
                yield piece(i)
        finally:
            closed.append(True)

    async def run():
        stream = every_n_tokens(source(), 4)
        got = [await anext(stream), await anext(stream)]
        await stream.aclose()
        return got

    got = asyncio.run(run())
    assert [d.token_ids for d in got] == [[0], [1, 2, 3, 4]] and closed == [True]


def test_the_server_streams_a_chunk_per_three_tokens(hf_engine):
    """hf_engine runs `--stream-interval 3`: chat and completions streams carry the same text
    and log-probs as the whole answer, in at most 1 + ceil((N - 1) / 3) chunks of text."""
    eng, directory = hf_engine
    c = openai.OpenAI(base_url=eng.url + "/v1", api_key=HF_KEY, max_retries=0)
    n = 16
    kw = dict(model=str(directory), max_tokens=n, temperature=0)
    messages = [{"role": "user", "content": "Count to twenty"}]
    whole = c.chat.completions.create(messages=messages, logprobs=True, **kw)
    chunks = list(c.chat.completions.create(messages=messages, logprobs=True, stream=True, **kw))
    texts = [ch.choices[0].delta.content for ch in chunks if ch.choices[0].delta.content]
    assert "".join(texts) == whole.choices[0].message.content
    streamed = [
        e for ch in chunks if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in whole.choices[0].logprobs.content]
    assert len(streamed) == n
    assert len(texts) <= 1 + math.ceil((n - 1) / 3), texts
    assert chunks[-1].choices[0].finish_reason == "length"
    prompt = "Once upon a time"
    whole = c.completions.create(prompt=prompt, **kw).choices[0].text
    parts = [x.choices[0].text for x in c.completions.create(prompt=prompt, stream=True, **kw)]
    parts = [p for p in parts if p]
    assert "".join(parts) == whole and len(parts) <= 1 + math.ceil((n - 1) / 3), parts


def test_a_request_raises_the_interval_never_lowers_it(engine_server, hf_engine):
    """`stream_interval` in a request (vLLM's and SGLang's request-level field): on a server
    at 1 it coalesces that request's stream; on a server at 3 a request asking 1 still gets 3;
    SGLang's /generate takes it in sampling_params; bad values get a 400 naming it."""
    n = 16
    c = openai.OpenAI(base_url=engine_server.url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model="tiny-random:7", max_tokens=n, temperature=0)
    messages = [{"role": "user", "content": "Count to twenty"}]
    whole = c.chat.completions.create(messages=messages, **kw).choices[0].message.content

    def texts(client, **more):
        chunks = client.chat.completions.create(messages=messages, stream=True, **kw, **more)
        return [ch.choices[0].delta.content for ch in chunks if ch.choices[0].delta.content]

    plain, four = texts(c), texts(c, extra_body={"stream_interval": 4})
    assert "".join(plain) == "".join(four) == whole
    assert len(four) <= 1 + math.ceil((n - 1) / 4) < len(plain), (four, plain)
    eng, directory = hf_engine
    h = openai.OpenAI(base_url=eng.url + "/v1", api_key=HF_KEY, max_retries=0)
    kw["model"] = str(directory)
    assert len(texts(h, extra_body={"stream_interval": 1})) <= 1 + math.ceil((n - 1) / 3)
    kw["model"] = "tiny-random:7"
    body = {"text": "Once upon a time", "stream": True}
    body["sampling_params"] = {"max_new_tokens": n, "temperature": 0, "stream_interval": 4}
    with httpx.stream("POST", engine_server.url + "/generate", json=body, timeout=60) as r:
        events = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    assert json.loads(events[-1][6:])["meta_info"]["completion_tokens"] == n
    assert len(events) <= 1 + math.ceil((n - 1) / 4), events
    for bad in (0, 2000, "x", 2.5, True):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(
                messages=messages, stream=True, **kw, extra_body={"stream_interval": bad}
            )
        assert e.value.body["param"] == "stream_interval", e.value.body
