"""litellm (the client library many agent frameworks call through) against the engine server:
its OpenAI-compatible providers get chats, streams, clear errors for refused parameters, and
authenticate with the API key."""

import os

import pytest

# the bundled price map, not a download at import (there is no network in CI)
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = pytest.importorskip("litellm")

from tests.api.conftest import HF_KEY  # noqa: E402

MODEL = "tiny-random:7"
MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(params=["openai", "hosted_vllm"])
def call(request, engine_server):
    """litellm.completion through one provider, pointed at the engine server."""

    def completion(**kw):
        return litellm.completion(
            model=f"{request.param}/{MODEL}",
            api_base=engine_server.url + "/v1",
            api_key="unused",
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            num_retries=0,
            **kw,
        )

    return completion


def test_chat_and_stream_agree(call):
    r = call()
    text = r.choices[0].message.content
    assert text and r.usage.completion_tokens == 6
    streamed = "".join(c.choices[0].delta.content or "" for c in call(stream=True))
    assert streamed == text


@pytest.mark.parametrize("param,value", [("n", 2), ("frequency_penalty", 0.5)])
def test_a_refused_parameter_is_a_clear_bad_request(call, param, value):
    with pytest.raises(litellm.BadRequestError) as e:
        call(**{param: value})
    assert param in str(e.value)


def test_the_api_key_authenticates(hf_engine):
    eng, directory = hf_engine

    def completion(key):
        return litellm.completion(
            model=f"openai/{directory}",
            api_base=eng.url + "/v1",
            api_key=key,
            messages=MESSAGES,
            max_tokens=3,
            num_retries=0,
        )

    assert completion(HF_KEY).usage.completion_tokens >= 1
    with pytest.raises(litellm.AuthenticationError) as e:
        completion("wrong-key")
    assert "API key" in str(e.value) or "api key" in str(e.value).lower()


def test_logprobs_and_logit_bias_through_litellm(call):
    plain = call(logprobs=True, top_logprobs=2)
    content = plain.choices[0].logprobs["content"]
    assert len(content) == 6
    first = content[0]
    assert first["logprob"] <= 0 and len(first["top_logprobs"]) >= 2
    # forbid the greedy first token: the answer must change, and its logprob (raw, before the
    # bias) is still reported among the alternatives
    from ddserve.engine.weights import load_tokenizer

    tok = load_tokenizer(MODEL)
    first_id = tok.encode(first["token"], add_special_tokens=False)
    if len(first_id) == 1:
        biased = call(logit_bias={str(first_id[0]): -100})
        assert biased.choices[0].message.content != plain.choices[0].message.content


def test_list_prompts_through_litellm_text_completion(engine_server):
    r = litellm.text_completion(
        model=f"openai/{MODEL}",
        api_base=engine_server.url + "/v1",
        api_key="unused",
        prompt=["One", "Two three"],
        max_tokens=4,
        temperature=0,
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.text for c in r.choices) and r.usage.completion_tokens == 8
