"""What a server says about its requests: metrics, a periodic stats line, an access log.

The metrics' one definition and the engine server's exporter: ddserve.api.prometheus (a
replica's: ddserve.serve.metrics). `MeteredBackend` is the one place that turns request stats
(`RequestStats`) into metrics, whichever exporter receives them.

Speculative decoding, counted per verify round from the request's accept lengths (tokens
committed in the round = accepted draft tokens + the bonus token):
    drafts          rounds that verified a draft tree
    draft_tokens    tree nodes verified (estimated from the live budget/topk and the
                    drafter's depth: the engine does not report per-round tree sizes yet)
    accepted_tokens draft tokens accepted; accepted_tokens_per_pos{position=p}: rounds
                    whose accepted path reached depth p+1 (vLLM's per-position counter)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from ddserve.api.generation import Delta
from ddserve.api.prometheus import CONFIG_LABELS, LOAD_GAUGES
from ddserve.engine.sampling import RequestStats, SamplingParams
from ddserve.errors import DDServeError

log = logging.getLogger(__name__)
access_log = logging.getLogger("ddserve.access")


def drafter_depth(drafter: dict) -> int:
    """The depth a drafter drafts to, from an engine config's `drafter` section (0: none)."""
    return 0 if drafter.get("kind", "none") == "none" else int(drafter.get("depth", 0))


def tree_size(budget: int, topk: int, depth: int) -> int:
    """Draft nodes in a best-first tree: `budget`, or fewer when `depth` levels of `topk`
    candidates each cannot hold that many (ddserve.engine.tree)."""
    depth = min(depth, budget)
    room = sum(topk**d for d in range(1, depth + 1)) if topk > 1 else depth
    return max(0, min(budget, room))


class MeteredBackend:
    """Wraps a Backend; records every request's metrics around `stream`, keeps the totals
    the stats line reads, and publishes the live config.

    `load()` returns the engine's gauges (LOAD_GAUGES, any subset) when the caller can read
    them; `drafter_depth` is the drafter's depth (0: no drafter). `record_reconfig`: count
    `update_params` as reconfigurations (the engine server; a replica counts its own,
    verification included)."""

    def __init__(
        self,
        inner,
        exporter,
        *,
        drafter_depth: int = 0,
        load: Callable[[], dict] | None = None,
        record_reconfig: bool = False,
    ):
        self.inner = inner
        self.exporter = exporter
        self.drafter_depth = drafter_depth
        self.load = load or (lambda: self._last_load)  # else: what a poller last gave
        self._last_load: dict = {}
        self.record_reconfig = record_reconfig
        self.inflight = 0
        self.totals = dict.fromkeys(
            ("requests", "errors", "prompt_tokens", "generation_tokens", "verify_rounds",
             "draft_tokens", "accepted_tokens"),
            0,
        )  # fmt: skip
        self._config: dict | None = None
        self._publish_config()
        if hasattr(inner, "on_params"):  # changed through another API process
            inner.on_params = self._publish_config

    def __getattr__(self, name):
        return getattr(self.inner, name)

    # -- gauges -------------------------------------------------------------------------
    def _publish_config(self) -> None:
        i = self.inner
        p = i.params.model_dump()
        labels = {"fingerprint": i.fingerprint, "engine": getattr(i, "kind", "builtin")}
        labels |= {k: str(p[k]) for k in CONFIG_LABELS if k in p}
        if self._config and self._config != labels:
            self.exporter.set("config_info", 0.0, **self._config)
        self.exporter.set("config_info", 1.0, **labels)
        self._config = labels

    def refresh_gauges(self, load: dict | None = None) -> dict:
        """Set the engine-load gauges (from `load`, given by a poller, else `self.load()`);
        returns them."""
        if load is None:
            load = self.load()
        else:
            self._last_load = load
        for name in LOAD_GAUGES:
            if name in load:
                self.exporter.set(name, float(load[name]))
        self.exporter.refresh()
        return load

    # -- live parameters ----------------------------------------------------------------
    async def update_params(self, changes: dict) -> dict:
        t0 = time.perf_counter()
        try:
            result = await self.inner.update_params(changes)
        except DDServeError:
            if self.record_reconfig:
                self.reconfigured(False, time.perf_counter() - t0)
            raise
        self._publish_config()
        if self.record_reconfig:
            self.reconfigured(True, time.perf_counter() - t0)
        return result

    def reconfigured(self, ok: bool, seconds: float) -> None:
        self.exporter.inc("reconfigurations", result="applied" if ok else "failed")
        self.exporter.observe("reconfigure_duration_seconds", seconds)

    async def refresh(self) -> None:
        await self.inner.refresh()
        self._publish_config()

    # -- requests -----------------------------------------------------------------------
    async def stream(self, prompt: list[int], sampling: SamplingParams) -> AsyncIterator[Delta]:
        ex = self.exporter
        t0 = last = time.perf_counter()
        first, status = True, "cancelled"
        params = self.inner.params  # the tree the request's rounds draft (estimate)
        self.inflight += 1
        try:
            async for d in self.inner.stream(prompt, sampling):
                now = time.perf_counter()
                n = max(len(d.token_ids), 1 if d.text else 0)
                if first and n:
                    ex.observe("time_to_first_token_seconds", now - t0)
                    first = False
                elif n:  # once per output iteration, as vLLM: the chunk's gap per token
                    ex.observe("inter_token_latency_seconds", (now - last) / n)
                if n:
                    last = now
                if d.finish_reason is not None:
                    self._record_finish(d.stats, len(prompt), now - t0, params)
                    status = "ok"
                yield d
        except DDServeError as exc:
            status = "client_error" if exc.status_code < 500 else "error"
            exc.counted = True
            raise
        finally:
            self.inflight -= 1
            self.totals["requests"] += 1
            self.totals["errors"] += status == "error"
            ex.inc("requests", status=status)

    def refused(self) -> None:
        """A request refused before the engine took it (its body, its model, its prompt's
        length, admission): a finished request of status client_error in
        `ddserve:requests_total`, as one the engine refused is (the stats line counts the
        engine's requests alone)."""
        self.exporter.inc("requests", status="client_error")

    def _record_finish(self, st: RequestStats | None, prompt_len: int, e2e: float, params) -> None:
        ex, t = self.exporter, self.totals
        ex.observe("e2e_request_latency_seconds", e2e)
        ex.inc("prompt_tokens", prompt_len)
        t["prompt_tokens"] += prompt_len
        if st is None:
            return
        if st.finish_s > 0:  # the engine's phases (builtin engine; SGLang reports none)
            ex.observe("request_queue_time_seconds", st.queue_s)
            ex.observe("request_prefill_time_seconds", st.first_token_s - st.queue_s)
            ex.observe("request_decode_time_seconds", st.finish_s - st.first_token_s)
            ex.observe("request_inference_time_seconds", st.finish_s - st.queue_s)
        ex.inc("generation_tokens", st.completion_tokens)
        ex.inc("verify_rounds", st.verify_rounds)
        t["generation_tokens"] += st.completion_tokens
        t["verify_rounds"] += st.verify_rounds
        # per-round lengths when the engine reports them (builtin), else the request's mean
        lengths = st.accept_lengths or [st.tau] * st.verify_rounds
        for n in lengths:
            ex.observe("accept_length", n)
        # drafted nodes as the engine counted them (builtin), else the configured tree's size
        size = tree_size(params.budget, params.topk, self.drafter_depth)
        drafted = st.draft_tokens or len(lengths) * size
        if not drafted:
            return
        drafts = len(lengths)
        accepted = [max(0, round(n) - 1) for n in lengths]  # the bonus token is not drafted
        ex.inc("spec_decode_num_drafts", drafts)
        ex.inc("spec_decode_num_draft_tokens", drafted)
        ex.inc("spec_decode_num_accepted_tokens", sum(accepted))
        t["draft_tokens"] += drafted
        t["accepted_tokens"] += sum(accepted)
        for pos in range(max(accepted, default=0)):
            ex.inc(
                "spec_decode_num_accepted_tokens_per_pos",
                sum(a > pos for a in accepted),
                position=str(pos),
            )


class StatsLog:
    """A line every `interval_s` while the server has work, like vLLM's and SGLang's:

    engine stats: running 2, waiting 0, KV slots 2/32, prompt 310.2 tok/s,
    generation 61.5 tok/s, tau 2.31, acceptance 0.44, requests 12 (0 errors)
    """

    def __init__(self, backend: MeteredBackend, interval_s: float = 10.0):
        self.backend, self.interval_s = backend, interval_s
        self._last = dict(backend.totals)
        self._t = time.monotonic()

    def line(self) -> str | None:
        """The line for the interval since the last call; None when it was idle."""
        b = self.backend
        now, totals = time.monotonic(), dict(b.totals)
        d = {k: totals[k] - self._last[k] for k in totals}
        dt = max(now - self._t, 1e-9)
        self._last, self._t = totals, now
        load = b.refresh_gauges()
        running = load.get("num_requests_running", b.inflight)
        if not (running or load.get("num_requests_waiting") or d["requests"]):
            return None
        slots = ""
        if "kv_slots_used" in load:
            total = load.get("kv_slots_total")
            slots = f", KV slots {load['kv_slots_used']}" + (f"/{total}" if total else "")
        tau = d["generation_tokens"] / d["verify_rounds"] if d["verify_rounds"] else 0.0
        acc = d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else 0.0
        return (
            f"engine stats: running {running}, waiting {load.get('num_requests_waiting', 0)}"
            f"{slots}, prompt {d['prompt_tokens'] / dt:.1f} tok/s, "
            f"generation {d['generation_tokens'] / dt:.1f} tok/s, tau {tau:.2f}, "
            f"acceptance {acc:.2f}, requests {d['requests']} ({d['errors']} errors)"
        )

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                line = self.line()
            except Exception as exc:  # never let the stats line take the server down
                log.warning("stats line failed: %s", exc)
                continue
            if line:
                log.info("%s", line)


def engine_load(backend) -> Callable[[], dict] | None:
    """The engine's load gauges when the backend can tell them (`load_gauges()`: the builtin
    engine in this process, or its engine core over the channel); None otherwise."""
    return getattr(backend, "load_gauges", None)


class AccessLog:
    """Pure ASGI middleware: one line per HTTP request when it ends (its stream included):
    `127.0.0.1:51234 "POST /v1/chat/completions HTTP/1.1" 200 1.532s`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [0]

        async def send_(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_)
        finally:
            client = scope.get("client") or ("-", 0)
            access_log.info(
                '%s:%s "%s %s HTTP/%s" %s %.3fs',
                client[0],
                client[1],
                scope["method"],
                scope["path"],
                scope.get("http_version", "1.1"),
                status[0] or "-",
                time.perf_counter() - t0,
            )
