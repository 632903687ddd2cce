"""What the OpenAI layer needs from an engine: the `Backend` protocol `create_app` is written
against. Implementations: `ddserve.backends.local.LocalBackend` (the builtin engine in this
process) and `ddserve.backends.remote.RemoteBackend` (an engine process over loopback HTTP,
builtin or SGLang).

Streaming and error contract of `stream(prompt_ids, sampling)`: an async iterator of `Delta`;
the last one has `finish_reason` and `stats`. Errors before the first Delta raise
(`InvalidRequest`, `EngineError`, `EngineUnavailable`); after it they raise from the iterator
(the API turns them into an error event). Closing the iterator early cancels the request and
frees its engine resources.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from ddserve.api.generation import Delta
from ddserve.config.engine import LiveParams
from ddserve.engine.sampling import SamplingParams


@runtime_checkable
class Backend(Protocol):
    @property
    def model_id(self) -> str:
        """The model id served in the OpenAI API."""

    @property
    def tokenizer(self) -> Any:
        """The served model's tokenizer (chat template, encode, decode)."""

    @property
    def max_context(self) -> int:
        """Longest prompt + completion, in tokens."""

    @property
    def params(self) -> LiveParams:
        """The live parameters in force (sampling defaults among them)."""

    @property
    def fingerprint(self) -> str:
        """Short hash of the engine's effective config."""

    def stream(self, prompt: list[int], sampling: SamplingParams) -> AsyncIterator[Delta]:
        """Generate; see the module docstring for the streaming and error contract."""

    async def check_health(self) -> float:
        """A real generation; returns its latency in seconds or raises EngineUnavailable."""

    def info(self) -> dict:
        """A JSON-able description of the engine (never secrets)."""

    async def update_params(self, changes: dict) -> dict:
        """Validate and apply live parameters (raises InvalidRequest), then report them."""
