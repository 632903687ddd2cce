"""What a value in a request body must be (ddserve.api.protocol's bodies share these checks):
text that UTF-8 carries, token ids and stop strings that fit the wire, the temperature's
floor, logit_bias's shape, and the OpenAI parameters refused by name."""

from __future__ import annotations

from ddserve.config.base import MAX_INT
from ddserve.config.engine import MIN_TEMPERATURE
from ddserve.engine.sampling import MAX_ABS_BIAS, MAX_LOGIT_BIAS

# what torch.Generator.manual_seed takes (a negative seed counts modulo 2**64, as in torch)
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1
# stop strings of one request at most (OpenAI takes 4; vLLM and SGLang set no bound, but each is
# matched against every chunk of text the request streams, in the API process)
MAX_STOP = 256


def unicode_text(text: str) -> str:
    """Text that UTF-8 can carry: JSON's \\uD800-\\uDFFF escapes decode to lone surrogates,
    which no tokenizer encodes (and the wire to the engine refuses)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"not valid Unicode: a lone surrogate (U+{ord(text[exc.start]):04X}) at "
                f"character {exc.start}"
            ) from None
    return text


def token_ids(ids: list[int]) -> list[int]:
    """Token ids that fit the wire (ids past the model's vocabulary are refused by the
    engine, which knows its size)."""
    for t in ids:
        if not 0 <= t <= MAX_INT:
            raise ValueError(f"token ids are integers in [0, {MAX_INT}]; {t} is not one")
    return ids


def check_stop(v: str | list[str] | None) -> str | list[str] | None:
    stops = [v] if isinstance(v, str) else v or []
    if len(stops) > MAX_STOP:
        raise ValueError(f"{len(stops)} stop strings; at most {MAX_STOP} are accepted")
    for text in stops:
        unicode_text(text)
    return v


def null_is_default(cls, v, info):
    """An explicit null takes the field's default, as OpenAI's API does for n, stream, echo
    (and SGLang's for sampling_params)."""
    if v is not None:
        return v
    return cls.model_fields[info.field_name].get_default(call_default_factory=True)


def temperature_floor(v: float | None) -> float | None:
    if v is not None and 0.0 < v < MIN_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
    return v


# OpenAI parameters the engine does not honour: refused with a 400 that names them unless the
# value is one that changes nothing (never silently ignored). name -> (no-op values, why)
REFUSED: dict[str, tuple[tuple, str]] = {
    "frequency_penalty": ((None, 0, 0.0), "penalties would change the target distribution"),
    "presence_penalty": ((None, 0, 0.0), "penalties would change the target distribution"),
    "repetition_penalty": ((None, 1, 1.0), "penalties would change the target distribution"),
    "tools": ((None, []), "tool calling needs a model with a tool template"),
    "tool_choice": ((None, "none"), "tool calling needs a model with a tool template"),
    "functions": ((None, []), "tool calling needs a model with a tool template"),
    "function_call": ((None, "none"), "tool calling needs a model with a tool template"),
    "response_format": (
        (None, {"type": "text"}),
        "structured output (json_object, json_schema) is not enforced",
    ),
    "best_of": ((None, 1), "one sequence per request"),
    "suffix": ((None, ""), "insertion (suffix) is not supported"),
}


def check_logit_bias(v: dict | None) -> dict | None:
    """{token id as a decimal string: bias in [-100, 100]}, at most MAX_LOGIT_BIAS entries
    (ids beyond the vocabulary are refused by the engine, which knows its size)."""
    if not v:
        return v
    if len(v) > MAX_LOGIT_BIAS:
        raise ValueError(f"{len(v)} entries; at most {MAX_LOGIT_BIAS} are accepted")
    for key, bias in v.items():
        if not (
            key.isascii() and key.isdigit() and len(key.lstrip("0")) <= 10 and int(key) < 1 << 31
        ):
            shown = key if len(key) <= 24 else key[:21] + "..."
            raise ValueError(f"keys are token ids (non-negative integers); {shown!r} is not one")
        if not -MAX_ABS_BIAS <= bias <= MAX_ABS_BIAS:
            raise ValueError(
                f"the bias of token {key} is {bias:g}; it must be in [{-MAX_ABS_BIAS:g}, {MAX_ABS_BIAS:g}]"
            )
    return v


def is_noop(value, noops: tuple) -> bool:
    """Whether `value` is one of the no-op values, of a matching JSON type: true is not 1 and
    false is not 0 (`==` would say they are), whatever else is numerically equal is."""
    return any(value == v and (type(value) is bool) == (type(v) is bool) for v in noops)


def refuse_unsupported(v, info):
    noop, why = REFUSED[info.field_name]
    if not is_noop(v, noop):
        raise ValueError(f"not supported: {why}")
    return v
