"""`RemoteBackend`: the Backend protocol (ddserve.api.backend) over an engine's HTTP API.

Speaks the SGLang-compatible subset both engines share: streamed native `/generate` with
`input_ids` (cumulative `text`, `meta_info` with `completion_tokens`, `spec_verify_ct`,
`finish_reason`), `/health_generate` (a real generation), and for the builtin engine
`/server_info` and `/admin/params`. SGLang has no live parameters: sampling defaults are
applied here, per request; tree parameters need a new engine (the reconfig controller's job).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import httpx

from ddserve.api.generation import Delta
from ddserve.backends.sglang import RESTART_FIELDS
from ddserve.config.engine import EngineConfig, LiveParams
from ddserve.engine.sampling import RequestStats, SamplingParams
from ddserve.errors import (
    Conflict,
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    error_from_body,
)

_CONN_ERRORS = (
    httpx.ConnectError,
    httpx.ReadError,
    httpx.RemoteProtocolError,
    httpx.WriteError,
    httpx.PoolTimeout,
    httpx.ConnectTimeout,
)


class RemoteBackend:
    """What both engines' HTTP APIs share; `for_config` picks the engine's own subclass."""

    kind = ""

    def __init__(self, url: str, cfg: EngineConfig, tokenizer, *, admin_token: str | None = None):
        self.url = url.rstrip("/")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.model_id = cfg.model_id
        self.admin_token = admin_token
        self.params: LiveParams = cfg.params
        self.fingerprint = cfg.fingerprint()
        self.max_context = cfg.max_context or 2048
        self.last_success = 0.0  # monotonic time of the last request that completed
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))

    @staticmethod
    def for_config(
        url: str, cfg: EngineConfig, tokenizer, *, admin_token: str | None = None
    ) -> RemoteBackend:
        cls = {"builtin": BuiltinRemote, "sglang": SGLangRemote}[cfg.kind]
        return cls(url, cfg, tokenizer, admin_token=admin_token)

    async def refresh(self) -> None:
        """Read what the engine says of itself (its config, its context length)."""
        raise NotImplementedError

    async def _get_json(self, path: str) -> dict:
        try:
            r = await self._client.get(self.url + path, timeout=30)
        except _CONN_ERRORS as exc:
            raise EngineUnavailable(
                f"engine at {self.url} unreachable: {type(exc).__name__}"
            ) from exc
        if r.status_code != 200:
            raise EngineUnavailable(f"engine {path} answered HTTP {r.status_code}")
        return r.json()

    def _sampling_body(self, sp: SamplingParams) -> dict:
        body = {
            "max_new_tokens": sp.max_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k if sp.top_k > 0 else -1,
            "ignore_eos": sp.ignore_eos,
        }
        if sp.stop:
            body["stop"] = list(sp.stop)
        if sp.stop_token_ids:
            body["stop_token_ids"] = list(sp.stop_token_ids)
        if sp.seed is not None:
            body["seed"] = body["sampling_seed"] = sp.seed
        return body

    async def stream(self, prompt: list[int], sampling: SamplingParams) -> AsyncIterator[Delta]:
        # not passed on over this API: refused by name rather than silently dropped
        if sampling.logprobs is not None:
            raise InvalidRequest(
                f"logprobs are not returned by the {self.kind} engine over HTTP", param="logprobs"
            )
        if sampling.logit_bias:
            raise InvalidRequest(
                f"logit_bias is not applied by the {self.kind} engine over HTTP",
                param="logit_bias",
            )
        body = {
            "input_ids": prompt,
            "sampling_params": self._sampling_body(sampling),
            "stream": True,
        }
        text, n_ids = "", 0
        try:
            async with self._client.stream("POST", self.url + "/generate", json=body) as r:
                if r.status_code != 200:
                    raise error_from_body(r.status_code, await r.aread())
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    obj = json.loads(data)
                    if "error" in obj:
                        raise EngineError(
                            f"engine failed mid-stream: {obj['error'].get('message', obj['error'])}"
                        )
                    new_text = obj.get("text", "")
                    delta, text = new_text[len(text) :], new_text
                    ids = obj.get("output_ids") or []
                    new_ids, n_ids = ids[n_ids:], len(ids)
                    meta = obj.get("meta_info") or {}
                    fp = obj.get("system_fingerprint") or self.fingerprint
                    finish = (meta.get("finish_reason") or {}).get("type")
                    if finish == "abort":
                        raise EngineError(
                            f"engine aborted the request: {meta['finish_reason'].get('message', '')}"
                        )
                    if finish:
                        self.last_success = time.monotonic()
                        yield Delta(delta, new_ids, fp, finish, _stats(meta, len(prompt)))
                        return
                    yield Delta(delta, new_ids, fp)
        except _CONN_ERRORS as exc:
            raise EngineUnavailable(f"lost the engine at {self.url}: {type(exc).__name__}") from exc
        raise EngineUnavailable("the engine closed the stream without finishing the request")

    async def check_health(self, timeout: float = 120.0) -> float:
        t0 = time.monotonic()
        try:
            r = await self._client.get(self.url + "/health_generate", timeout=timeout)
        except (httpx.TimeoutException, *_CONN_ERRORS) as exc:
            raise EngineUnavailable(
                f"engine health generation failed: {type(exc).__name__}"
            ) from exc
        if r.status_code != 200:
            raise EngineUnavailable(
                f"engine health generation answered HTTP {r.status_code}: {r.text[:200]}"
            )
        self._healthy(r.json())
        return time.monotonic() - t0

    def _healthy(self, body: dict) -> None:
        """What a health generation's answer tells about the engine (nothing, by default)."""

    def info(self) -> dict:
        return {
            "engine": self.kind,
            "engine_url": self.url,
            "model": self.model_id,
            "system_fingerprint": self.fingerprint,
            "params": self.params.model_dump(),
            "max_context": self.max_context,
        }

    async def update_params(self, changes: dict) -> dict:
        raise NotImplementedError

    async def aclose(self) -> None:
        await self._client.aclose()


class BuiltinRemote(RemoteBackend):
    """ddserve's own engine process: its config, fingerprint and live parameters are its own."""

    kind = "builtin"

    async def refresh(self) -> None:
        info = await self._get_json("/server_info")
        self.params = LiveParams.model_validate(info["config"]["params"])
        self.fingerprint = info["system_fingerprint"]
        self.max_context = info["max_context"]

    def _healthy(self, body: dict) -> None:
        self.fingerprint = body.get("system_fingerprint", self.fingerprint)

    async def update_params(self, changes: dict) -> dict:
        headers = {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}
        try:
            r = await self._client.post(
                self.url + "/admin/params", json=changes, headers=headers, timeout=30
            )
        except _CONN_ERRORS as exc:
            raise EngineUnavailable(f"engine unreachable: {type(exc).__name__}") from exc
        if r.status_code != 200:
            raise error_from_body(r.status_code, r.content)
        await self.refresh()
        return {"params": self.params.model_dump(), "system_fingerprint": self.fingerprint}


class SGLangRemote(RemoteBackend):
    """An SGLang server: no live parameters, so sampling defaults are applied here, per
    request; tree parameters need a new engine (the reconfig controller's job)."""

    kind = "sglang"

    async def refresh(self) -> None:
        info = await self._get_json("/get_server_info")
        self.max_context = int(info.get("context_length") or self.max_context)

    async def update_params(self, changes: dict) -> dict:
        restart = sorted(RESTART_FIELDS & set(changes))
        if restart:
            raise Conflict(
                f"SGLang needs a restart to change {', '.join(restart)}; use `ddserve reconfig`"
            )
        self.params = self.cfg.with_params(**{**self.params.model_dump(), **changes}).params
        self.cfg = self.cfg.model_copy(update={"params": self.params})
        self.fingerprint = self.cfg.fingerprint()
        return {"params": self.params.model_dump(), "system_fingerprint": self.fingerprint}


def _stats(meta: dict, prompt_len: int) -> RequestStats:
    st = RequestStats(
        prompt_tokens=meta.get("prompt_tokens", prompt_len),
        completion_tokens=meta.get("completion_tokens", 0),
        verify_rounds=meta.get("spec_verify_ct", 0),
    )
    ext = meta.get("ddtree") or {}  # the builtin engine's timings
    st.draft_s = ext.get("draft_ms", 0.0) / 1e3
    st.verify_s = ext.get("verify_ms", 0.0) / 1e3
    st.prefill_s = ext.get("prefill_ms", 0.0) / 1e3
    hist = meta.get("spec_accept_histogram")
    if hist:
        st.accept_lengths = [int(k) for k, n in hist.items() for _ in range(int(n))]
    if not st.verify_rounds:  # an engine without speculation: one token per forward
        st.verify_rounds = st.completion_tokens
    return st
