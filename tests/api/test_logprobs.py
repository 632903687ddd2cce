"""logprobs / top_logprobs and logit_bias through the engine server (engine core process,
its channel, the OpenAI layer), driven by the official openai client: shapes, stream ==
non-stream at T=0, raw log-probs (before the bias), the stop-string rule, and 400s."""

import httpx
import openai
import pytest

from ddserve.api.generation import TextStream
from ddserve.engine.sampling import Logprobs, SamplingParams
from ddserve.errors import EngineError
from tests.api.test_engine_server import MODEL

PROMPT = "Once upon a time"


@pytest.fixture()
def client(engine_server):
    return openai.OpenAI(base_url=engine_server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], temperature=0, **kw
    )


def complete(client, **kw):
    return client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, **kw)


def greedy_ids(engine_server, n):
    r = httpx.post(
        engine_server.url + "/generate",
        json={"text": PROMPT, "sampling_params": {"max_new_tokens": n, "temperature": 0}},
    )
    return r.json()["output_ids"]


def test_chat_logprobs_stream_and_non_stream_agree(client):
    r = chat(client, max_tokens=8, logprobs=True, top_logprobs=3)
    text, content = r.choices[0].message.content, r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        # greedy, no bias: the emitted token is the most likely one
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
    # each token's bytes, joined, are the answer's text
    assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == text
    chunks = list(chat(client, max_tokens=8, logprobs=True, top_logprobs=3, stream=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    assert chat(client, max_tokens=2).choices[0].logprobs is None  # not asked: none


def test_completion_logprobs_stream_and_non_stream_agree(client):
    c = complete(client, max_tokens=6, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert tok in top and top[tok] == value and len(top) <= 3  # N best + the chosen one
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    if "\ufffd" not in "".join(lp.tokens):  # whole characters: the tokens spell the text
        assert "".join(lp.tokens) == c.choices[0].text
        assert all(
            c.choices[0].text[o:].startswith(t)
            for o, t in zip(lp.text_offset, lp.tokens, strict=True)
        )
    chunks = list(complete(client, max_tokens=6, logprobs=2, stream=True))
    got = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ch in chunks:
        if ch.choices[0].logprobs:
            for key, values in got.items():
                values += getattr(ch.choices[0].logprobs, key)
    assert got == lp.model_dump()


def test_logprobs_stop_at_the_text_a_stop_string_cuts(client):
    """The entries are the tokens whose text was returned whole: their texts joined are a
    prefix of the (cut) text, the next token would reach past it; stream == non-stream."""
    full = complete(client, max_tokens=12, logprobs=0).choices[0]
    stop = full.text[len(full.text) // 2 :][:3]
    cut = complete(client, max_tokens=12, logprobs=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    n = len(cut.logprobs.tokens)
    assert n < len(full.logprobs.tokens) and cut.logprobs.tokens == full.logprobs.tokens[:n]
    if "\ufffd" not in "".join(full.logprobs.tokens):
        assert cut.text.startswith("".join(cut.logprobs.tokens))
        assert len("".join(full.logprobs.tokens[: n + 1])) > len(cut.text)
    chunks = list(complete(client, max_tokens=12, logprobs=0, stop=[stop], stream=True))
    streamed = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert streamed == cut.logprobs.tokens


def test_logit_bias_forbids_and_forces_tokens(client, engine_server):
    ids = greedy_ids(engine_server, 4)
    plain = complete(client, max_tokens=4, logprobs=1).choices[0]
    # -100 on the greedy first token: the answer changes; the log-probs stay raw (the
    # forbidden token is still the model's most likely one there, with its own log-prob)
    banned = complete(client, max_tokens=4, logprobs=1, logit_bias={str(ids[0]): -100}).choices[0]
    assert banned.text != plain.text
    assert banned.logprobs.tokens[0] != plain.logprobs.tokens[0]
    first = plain.logprobs.tokens[0]
    assert banned.logprobs.top_logprobs[0][first] == plain.logprobs.token_logprobs[0]
    # +100 forces a token at every position, streamed chat too
    forced = plain.logprobs.tokens[1]
    chunks = list(
        chat(client, max_tokens=5, logprobs=True, logit_bias={str(ids[1]): 100}, stream=True)
    )
    tokens = [
        e.token
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert tokens == [forced] * 5


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),  # needs logprobs=true
        ("chat", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("chat", {"logit_bias": {"5": 150}}, "logit_bias"),
        ("chat", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ("chat", {"logit_bias": {"49152": 1}}, "logit_bias"),  # past the vocabulary (engine)
        ("completions", {"logprobs": 6}, "logprobs"),
        ("completions", {"logprobs": True}, "logprobs"),
        ("completions", {"logprobs": 1, "echo": True}, "logprobs"),
        ("completions", {"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_logprobs_and_logit_bias_values_get_a_400(client, path, body, param):
    create = client.chat.completions.create if path == "chat" else client.completions.create
    where = {"messages": [{"role": "user", "content": "x"}]} if path == "chat" else {"prompt": "x"}
    with pytest.raises(openai.BadRequestError) as e:
        create(model=MODEL, max_tokens=2, **where, extra_body=body)
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


# -- the release rule, in-process (no model) ---------------------------------------------
class ByteTokenizer:
    """Token i is a byte string; decoding joins the bytes (half a character: U+FFFD)."""

    VOCAB = [b"ab", b"c", b" d", "é".encode()[:1], "é".encode()[1:], b"x", b""]

    def decode(self, ids, skip_special_tokens=False):
        return b"".join(self.VOCAB[i] for i in ids).decode(errors="replace")


def logprobs_of(ids):
    return Logprobs([-float(i) for i in ids], [[i] for i in ids], [[-float(i)] for i in ids])


@pytest.mark.parametrize("chunks", [[[0, 1, 2, 3, 4, 5, 6]], [[0], [1, 2, 3], [4, 5], [6]]])
def test_logprobs_are_released_with_their_text(chunks):
    """Entries come out once their token's text is out, whatever the chunking: the partial
    character's first token waits for the second, both end where the character does."""
    ts = TextStream(ByteTokenizer(), SamplingParams(logprobs=1))
    text, got = "", []
    for ids in chunks:
        text += ts.push(ids, logprobs_of(ids))
        got += ts.take()
    text += ts.flush()
    got += ts.take()
    assert text == "abc déx"
    assert [e.token_id for e in got] == list(range(7))
    assert [e.offset for e in got] == [0, 2, 3, 5, 6, 6, 7]
    assert [e.logprob for e in got] == [-float(i) for i in range(7)]


def test_a_stop_string_cuts_the_logprobs_with_the_text():
    """Stop "c d": the text ends before it; the token that holds its start ("c") and every
    later one are not returned ("c" waited while it could begin the stop string)."""
    ts = TextStream(ByteTokenizer(), SamplingParams(logprobs=0, stop=("c d",)))
    assert ts.push([0], logprobs_of([0])) == "ab" and [e.token_id for e in ts.take()] == [0]
    assert ts.push([1], logprobs_of([1])) == "" and ts.take() == []  # "c" may begin "c d"
    assert ts.push([2, 5], logprobs_of([2, 5])) == "" and ts.stopped
    assert ts.take() == []  # "c" is the stop string's start: not returned
    ts = TextStream(ByteTokenizer(), SamplingParams(logprobs=0))
    assert ts.push([0, 1], logprobs_of([0, 1])) == "abc"
    with pytest.raises(EngineError):
        ts.push([2], None)  # asked for, not delivered: an engine failure, not a silent gap
    plain = TextStream(ByteTokenizer(), SamplingParams())
    assert plain.push([0, 1], None) == "abc" and plain.take() is None
