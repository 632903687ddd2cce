"""What the OpenAI layer needs from an engine, and the in-process implementation.

Backend contract (`create_app` is written against it):
    model_id, tokenizer, max_context      what is served
    params                                the live parameters (sampling defaults among them)
    fingerprint                           short hash of the effective config
    stream(prompt_ids, sampling)          async iterator of Delta; the last has finish_reason
                                          and stats. Errors before the first Delta raise
                                          (InvalidRequest, EngineError, EngineUnavailable);
                                          closing the iterator early cancels the request.
    check_health()                        a real generation; returns its latency in seconds
    info()                                a JSON-able description (never secrets)
    update_params(changes)                validate + apply live parameters, or raise

`LocalBackend` runs the builtin engine in this process; the Ray replica talks to an engine
process over loopback HTTP with `service.serve.engine_client.RemoteBackend`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from service.config import LiveParams
from service.engine.runner import EngineRunner
from service.engine.sampling import SamplingParams
from service.server.generation import Delta
from service.server.text import Detokenizer


class LocalBackend:
    def __init__(self, runner: EngineRunner):
        self.runner = runner

    @property
    def model_id(self) -> str:
        return self.runner.config.model_id

    @property
    def tokenizer(self):
        return self.runner.tokenizer

    @property
    def max_context(self) -> int:
        return self.runner.max_context

    @property
    def params(self) -> LiveParams:
        return self.runner.config.params

    @property
    def fingerprint(self) -> str:
        return self.runner.fingerprint

    async def stream(self, prompt: list[int], sampling: SamplingParams) -> AsyncIterator[Delta]:
        detok = Detokenizer(self.runner.tokenizer, sampling.stop)
        async for out in self.runner.generate(prompt, sampling):
            text = detok.push(out.token_ids)
            if detok.stopped:  # a stop string ended it; leaving the loop cancels the request
                yield Delta(text, out.token_ids, out.fingerprint, "stop", out.stats)
                return
            if out.finished:
                yield Delta(
                    text + detok.flush(),
                    out.token_ids,
                    out.fingerprint,
                    out.finish_reason,
                    out.stats,
                )
                return
            yield Delta(text, out.token_ids, out.fingerprint)

    async def check_health(self) -> float:
        return await self.runner.check_health()

    def info(self) -> dict:
        r = self.runner
        return {
            "engine": "builtin",
            "model": self.model_id,
            "config": r.config.model_dump(),
            "system_fingerprint": r.fingerprint,
            "max_context": r.max_context,
            "load": r.load,
            "load_s": round(r.load_s, 2),
            "started_at": r.started_at,
        }

    async def update_params(self, changes: dict) -> dict:
        new = self.runner.update_params(**changes)
        return {"params": new.params.model_dump(), "system_fingerprint": self.runner.fingerprint}
