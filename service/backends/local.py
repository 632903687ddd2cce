"""`LocalBackend`: the `Backend` protocol (ddserve.api.backend) over the builtin engine running
in this process (`ddserve engine`). The Ray replica uses `ddserve.backends.remote.RemoteBackend`."""

from __future__ import annotations

from collections.abc import AsyncIterator

from ddserve.api.generation import Delta, TextStream
from ddserve.config.engine import LiveParams
from ddserve.engine.runner import EngineRunner
from ddserve.engine.sampling import SamplingParams


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
        ts = TextStream(self.runner.tokenizer, sampling)
        async for out in self.runner.generate(prompt, sampling):
            text = ts.push(out.token_ids, out.logprobs)
            if ts.stopped:  # a stop string ended it; leaving the loop cancels the request
                yield Delta(text, out.token_ids, out.fingerprint, "stop", out.stats, ts.take())
                return
            if out.finished:
                text += ts.flush()
                yield Delta(
                    text,
                    out.token_ids,
                    out.fingerprint,
                    out.finish_reason,
                    out.stats,
                    ts.take(),
                )
                return
            yield Delta(text, out.token_ids, out.fingerprint, logprobs=ts.take())

    def load_gauges(self) -> dict:
        return self.runner.load_gauges()

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
