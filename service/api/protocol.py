"""Request bodies of the OpenAI-compatible and native (SGLang-style) endpoints; the checks
of single values they share: ddserve.api.fields."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ddserve.api.fields import (
    MAX_SEED,
    MAX_STOP,
    MIN_SEED,
    REFUSED,
    check_logit_bias,
    check_stop,
    is_noop,
    null_is_default,
    refuse_unsupported,
    temperature_floor,
    token_ids,
    unicode_text,
)
from ddserve.config.base import MAX_INT
from ddserve.config.engine import MAX_TEMPERATURE, MIN_TEMPERATURE
from ddserve.engine.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS

MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs=N, as OpenAI's

TEMPERATURE = (
    f"Sampling temperature: 0 = greedy, else in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]; "
    "below the floor logits / T overflows float32, so such values are refused."
)
SEED = f"Seed of the request's sampler, in [{MIN_SEED}, {MAX_SEED}]; none: a fresh one."
# MAX_INT (ddserve.config.base): the largest integer a count or token id may take (what the
# engine's wire, msgpack, and its int32/int64 tensors carry without overflow: larger values
# are a client's mistake, a 400)
# prompts in one /v1/completions request at most: each is an engine request of its own (and
# counts against --max-requests)
MAX_PROMPTS = 64


def _prompt_count(v) -> None:
    """A completion's `prompt` list: not empty, and at most MAX_PROMPTS prompts."""
    if isinstance(v, list) and not v:
        raise ValueError("the prompt is empty")
    if isinstance(v, list) and not isinstance(v[0], int) and len(v) > MAX_PROMPTS:
        raise ValueError(
            f"{len(v)} prompts; at most {MAX_PROMPTS} in one request (send several requests)"
        )


STREAM_INTERVAL = (
    "Extension (vLLM's and SGLang's request-level stream_interval), streamed responses only: "
    "tokens per chunk after the first; raises the server's --stream-interval for this "
    "request, never lowers it."
)


class _Body(BaseModel):
    # unknown fields that cannot change the answer (user, metadata, store, ...) are accepted
    # and ignored; the OpenAI parameters that would change it and the engine does not do are
    # refused by name (Sampling, REFUSED). Types as OpenAI's API checks them (strict): a
    # count is a JSON integer (not "8", 8.0 or true), a flag a JSON boolean (not "yes" or 1),
    # a number not a string (an integer is a number); pydantic's lax coercion took
    # `"stream": "yes"` as true and `"max_tokens": "8"` as 8
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


class StreamOptions(_Body):
    """OpenAI's stream_options (others it may add are accepted and ignored)."""

    include_usage: bool | None = Field(
        None, description="A last chunk with the request's token usage."
    )


class Sampling(_Body):
    """Sampling fields shared by chat and completions; None = the engine's live default."""

    max_tokens: int | None = Field(
        None, gt=0, description="Completion tokens at most; default: the rest of the context."
    )
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE, description=TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(
        None, ge=0, le=MAX_INT, description="Extension: top-k filter; 0 = off."
    )
    stop: str | list[str] | None = Field(None, description=f"At most {MAX_STOP} strings.")
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED, description=SEED)
    n: int = Field(1, ge=1, le=1, description="Only one choice per request is supported.")
    ignore_eos: bool = Field(False, description="Extension: keep generating past EOS.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stream_interval: int | None = Field(None, ge=1, le=1024, description=STREAM_INTERVAL)
    logit_bias: dict[str, float] | None = Field(
        None,
        description=f"{{token id: bias in [-100, 100]}} (at most {MAX_LOGIT_BIAS}), added to the "
        "target's logits at every position before sampling (speculation stays exact).",
    )
    frequency_penalty: float | None = Field(None, description="Refused unless 0.")
    presence_penalty: float | None = Field(None, description="Refused unless 0.")
    repetition_penalty: float | None = Field(None, description="Refused unless 1.")
    tools: list | None = Field(None, description="Refused unless empty.")
    tool_choice: str | dict | None = Field(None, description="Refused unless 'none'.")
    functions: list | None = Field(None, description="Refused unless empty.")
    function_call: str | dict | None = Field(None, description="Refused unless 'none'.")
    response_format: dict | None = Field(None, description="Refused unless {'type': 'text'}.")
    best_of: int | None = Field(None, description="Refused unless 1.")
    suffix: str | None = Field(None, description="Refused unless empty.")

    _temperature = field_validator("temperature")(temperature_floor)
    _refused = field_validator(*REFUSED)(refuse_unsupported)
    _logit_bias = field_validator("logit_bias")(check_logit_bias)
    _stop = field_validator("stop")(check_stop)
    _null = field_validator("n", "stream", "ignore_eos", mode="before")(
        classmethod(null_is_default)
    )

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v, info):
        if v is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream=true")
        return v

    @property
    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs, one per id ("042" and "42" are one id: the
        last given wins, as in a JSON object)."""
        return tuple(sorted({int(k): float(b) for k, b in (self.logit_bias or {}).items()}.items()))

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token when log-probs are asked for, else None."""
        return None

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return tuple(s for s in stops if s)


class ContentPart(_Body):
    type: Literal["text"]
    text: str

    _text = field_validator("text")(unicode_text)


class Message(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        """A part of another type (an image, audio) named as such, not as a failed union
        (`content.str: Input should be a valid string`)."""
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(
                        f"part {i} is of type {kind!r}: this model takes text parts only"
                    )
        return v

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        return unicode_text(v) if isinstance(v, str) else v

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


RAW_LOGPROBS = (
    "raw log-probabilities: log_softmax of the model's logits before logit_bias, temperature, "
    "top-k and top-p (vLLM's default)"
)


class ChatCompletionRequest(Sampling):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool | None = Field(None, description=f"Return each token's {RAW_LOGPROBS}.")
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="The most likely tokens per position, with theirs; needs logprobs=true.",
    )

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v, info):
        if v and not info.data.get("logprobs"):
            raise ValueError("needs logprobs=true")
        return v

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _alias(self) -> ChatCompletionRequest:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


COMPLETION_MAX_TOKENS = 16


class CompletionRequest(Sampling):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description=f"Text or token ids, or a list of up to {MAX_PROMPTS} of either: one "
        "choice per prompt (its `index`), each generated as its own request."
    )
    # OpenAI's legacy completions (and vLLM's) stop at 16 tokens unless asked: a prompt
    # without max_tokens generated up to the whole context (8k tokens) here
    max_tokens: int | None = Field(
        COMPLETION_MAX_TOKENS, gt=0, description="Completion tokens at most; default 16."
    )
    echo: bool = False
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_COMPLETION_LOGPROBS,
        description=f"Return each token's {RAW_LOGPROBS}, and the N most likely tokens' at its position.",
    )
    top_logprobs: int | None = Field(None, description="Chat only: use logprobs=N here.")

    _null_defaults = field_validator("echo", "max_tokens", mode="before")(
        classmethod(null_is_default)
    )

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs(cls, v, info):
        if isinstance(v, bool):
            raise ValueError(
                f"an integer in [0, {MAX_COMPLETION_LOGPROBS}] here (true/false: chat)"
            )
        if v is not None and info.data.get("echo"):
            raise ValueError("not with echo=true (the prompt's log-probabilities are not returned)")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v):
        if v:
            raise ValueError("not a parameter of /v1/completions: use logprobs=N")
        return v

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        """One message for a prompt of none of the four shapes (not one per union member).
        Too many prompts are refused before any is looked at: an 8 MB body of 1.6M one-token
        prompts took ~8 s to validate on the API process's event loop, stalling its clients."""
        _prompt_count(v)

        def ids(x) -> bool:
            return isinstance(x, list) and all(type(i) is int for i in x)

        listed = isinstance(v, list) and (
            all(isinstance(x, str) for x in v) or all(ids(x) for x in v)
        )
        if isinstance(v, str):
            return unicode_text(v)
        if ids(v) or listed:
            for x in [v] if ids(v) else v:
                if isinstance(x, str):
                    unicode_text(x)
                else:
                    token_ids(x)
            return v
        raise ValueError(
            "must be a string, a list of strings, a list of token ids or a list of token-id lists"
        )

    @property
    def prompts(self) -> list[str | list[int]]:
        """One text or token-id list per choice."""
        one = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if one else list(self.prompt)


class NativeSampling(_Body):
    max_new_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE, description=TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT)
    stop: str | list[str] | None = Field(None, description=f"At most {MAX_STOP} strings.")
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP)
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED, description=SEED)
    stream_interval: int | None = Field(None, ge=1, le=1024, description=STREAM_INTERVAL)

    _temperature = field_validator("temperature")(temperature_floor)
    _stop = field_validator("stop")(check_stop)
    _null = field_validator("ignore_eos", mode="before")(classmethod(null_is_default))
    _stop_ids = field_validator("stop_token_ids")(lambda v: v if v is None else token_ids(v))

    @model_validator(mode="after")
    def _refused(self) -> NativeSampling:
        """SGLang's sampling parameters that would change the answer and this engine does not
        do: a 400 naming them (never silently ignored), unless at a value that changes
        nothing."""
        for name, value in (self.model_extra or {}).items():
            if name in NATIVE_REFUSED and not is_noop(value, NATIVE_REFUSED[name]):
                raise ValueError(
                    f"{name}={value!r} is not supported by this engine (accepted only as {NATIVE_REFUSED[name][0]!r} or left out)"
                )
        return self


# SGLang's /generate sampling_params this engine does not honour -> the values that are no-ops
NATIVE_REFUSED: dict[str, tuple] = {
    "frequency_penalty": (0.0, None),
    "presence_penalty": (0.0, None),
    "repetition_penalty": (1.0, None),
    "min_new_tokens": (0, None),
    "min_p": (0.0, None),
    "n": (1, None),
    "logit_bias": (None, {}),
    "regex": (None,),
    "json_schema": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "custom_params": (None,),
    "skip_special_tokens": (True, None),
    "spaces_between_special_tokens": (True, None),
}


class GenerateRequest(_Body):
    """SGLang's native /generate: text or input_ids, sampling_params, stream."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: NativeSampling = Field(default_factory=NativeSampling)
    stream: bool = False

    _text = field_validator("text")(lambda v: v if v is None else unicode_text(v))
    _ids = field_validator("input_ids")(lambda v: v if v is None else token_ids(v))
    _null = field_validator("stream", "sampling_params", mode="before")(
        classmethod(null_is_default)
    )

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `text` or `input_ids`")
        return self


class AdminParams(BaseModel):
    """POST /admin/params: the live parameters to change, any subset; nothing else."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    budget: int | None = Field(
        None, ge=-MAX_INT, le=MAX_INT, description="Draft tree nodes verified per round."
    )
    topk: int | None = Field(None, ge=-MAX_INT, le=MAX_INT, description="Candidates per depth.")
    window: int | None = Field(
        None, ge=-MAX_INT, le=MAX_INT, description="Recent tokens the drafter attends to."
    )
    temperature: float | None = Field(None, description="Default sampling temperature.")
    top_p: float | None = Field(None, description="Default nucleus mass.")
    top_k: int | None = Field(
        None, ge=-MAX_INT, le=MAX_INT, description="Default top-k filter; 0 = off."
    )
