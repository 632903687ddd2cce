"""What every config model shares: frozen, no unknown fields, integers within 32 bits, and
`Text` for strings that may reach a command line or an EnvironmentFile."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, field_validator

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def one_line(v: str) -> str:
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in v):
        raise ValueError("must not contain newlines or other control characters")
    return v


# A name, path or argument: it may end up in an EnvironmentFile or on a command line, where a
# newline would start a new assignment (`x\nLD_PRELOAD=...`), so control characters are refused.
Text = Annotated[str, AfterValidator(one_line)]


# the largest integer a config field holds (requests' limit too): what every process on the
# wire (msgpack to the engine process, Serve's reconfigure) and the engine's int32 tensors take
MAX_INT = (1 << 31) - 1


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("*")
    @classmethod
    def _int32(cls, v):
        """Integers within 32 bits: a live top_k of 10^20 passed validation and took every
        replica down at its reconfigure (msgpack's OverflowError)."""
        if isinstance(v, int) and not isinstance(v, bool) and not -MAX_INT <= v <= MAX_INT:
            raise ValueError(f"must be an integer of at most {MAX_INT} in size")
        return v
