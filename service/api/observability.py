"""What a server says about its requests: metrics, a periodic stats line, an access log.

One definition of the metrics (`METRICS`), two exporters:

    MeteredBackend(backend, PrometheusExporter(model_name))   the engine server's /metrics
    MeteredBackend(backend, RayExporter(model_name))          a Ray replica (ddserve.serve.metrics)

`MeteredBackend` is the one place that turns request stats (`RequestStats`) into metrics,
whichever exporter receives them. Names and labels follow vLLM and SGLang: a `ddserve:`
prefix and a `model_name` label (`ddserve:time_to_first_token_seconds`,
`ddserve:spec_decode_num_draft_tokens_total`, ...). Ray names cannot hold ':' and get a
`ray_` prefix, so a replica's `ddserve_x` is scraped as `ray_ddserve_x`; the scrape config
(deploy/prometheus.yml) renames it back to `ddserve:x`, and one dashboard reads both.

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
from dataclasses import dataclass

from ddserve.api.generation import Delta
from ddserve.engine.sampling import RequestStats, SamplingParams
from ddserve.errors import DDServeError

log = logging.getLogger(__name__)
access_log = logging.getLogger("ddserve.access")

PREFIX = "ddserve"
# fine where serving latencies live (a few ms to a few hundred: vLLM's TTFT buckets start at
# 1 ms), coarse beyond
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2,
    0.3, 0.6, 1.2, 2.5, 5, 10, 20, 40, 80,
)  # fmt: skip
# Ray's exporter rebuilds a histogram's _sum from bucket midpoints, so acceptance-length
# buckets are centred on the integers: every length up to 16 keeps an exact mean.
ACCEPT_BUCKETS = tuple(k + 0.5 for k in range(17)) + (24.5, 32.5, 64.5)
CONFIG_LABELS = (
    "fingerprint",
    "engine",
    "budget",
    "topk",
    "window",
    "temperature",
    "top_p",
    "top_k",
)
LOAD_GAUGES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_slots_used",
    "kv_slots_total",
    "spec_budget",
    "prefill_chunk_tokens",
)


@dataclass(frozen=True)
class Metric:
    """One metric, whatever exports it. `name` has no prefix and no `_total`."""

    name: str
    kind: str  # counter | gauge | histogram
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


METRICS = {
    m.name: m
    for m in [
        Metric("time_to_first_token_seconds", "histogram", "Request arrival to its first generated token.", buckets=LATENCY_BUCKETS),
        Metric("inter_token_latency_seconds", "histogram", "Time between generated tokens: one sample per streamed chunk (its gap over the tokens it carries), as vLLM samples once per output iteration.", buckets=LATENCY_BUCKETS),
        Metric("e2e_request_latency_seconds", "histogram", "Request arrival to its last token.", buckets=LATENCY_BUCKETS),
        Metric("request_queue_time_seconds", "histogram", "The engine's receipt of a request to its prompt's first prefill forward (vLLM's queue phase; builtin engine).", buckets=LATENCY_BUCKETS),
        Metric("request_prefill_time_seconds", "histogram", "First prefill forward to the first token (vLLM's prefill phase; builtin engine).", buckets=LATENCY_BUCKETS),
        Metric("request_decode_time_seconds", "histogram", "First token to the last, in the engine (vLLM's decode phase; builtin engine).", buckets=LATENCY_BUCKETS),
        Metric("request_inference_time_seconds", "histogram", "First prefill forward to the last token (prefill + decode; builtin engine).", buckets=LATENCY_BUCKETS),
        Metric("prompt_tokens", "counter", "Prompt tokens of finished requests."),
        Metric("generation_tokens", "counter", "Generated (completion) tokens."),
        Metric("requests", "counter", "Finished requests by status (ok, client_error, error, cancelled).", ("status",)),
        Metric("num_requests_running", "gauge", "Requests the engine is decoding now."),
        Metric("num_requests_waiting", "gauge", "Requests waiting for the engine (a KV slot)."),
        Metric("kv_slots_used", "gauge", "KV cache slots held by requests (one per running request)."),
        Metric("kv_slots_total", "gauge", "KV cache slots of the engine's pool (static engine only)."),
        Metric("spec_budget", "gauge", "Draft budget (tree nodes) of the engine's last round: the live budget, or below it under --speculative-adaptive or spec_max_batch (builtin engine)."),
        Metric("prefill_chunk_tokens", "gauge", "Prompt tokens the engine's next round may prefill while other requests decode (chunked prefill paced to --chunked-prefill-steps decode steps, within --chunked-prefill-size); 0 = no limit (builtin engine)."),
        Metric("verify_rounds", "counter", "Target verify forwards (decoding rounds); tokens / rounds = tau."),
        Metric("accept_length", "histogram", "Tokens committed per verify round (acceptance length, tau).", buckets=ACCEPT_BUCKETS),
        Metric("spec_decode_num_drafts", "counter", "Verify rounds that verified a draft tree."),
        Metric("spec_decode_num_draft_tokens", "counter", "Draft tree nodes verified (estimated from budget, topk, depth)."),
        Metric("spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted."),
        Metric("spec_decode_num_accepted_tokens_per_pos", "counter", "Rounds whose accepted path reached depth position+1.", ("position",)),
        Metric("config_info", "gauge", "1 for the live config (labels), 0 for configs left.", CONFIG_LABELS),
        Metric("reconfigurations", "counter", "Live reconfigurations, by result (applied, failed).", ("result",)),
        Metric("reconfigure_duration_seconds", "histogram", "Time to apply (and on Ray verify) a live reconfiguration.", buckets=LATENCY_BUCKETS),
    ]
}  # fmt: skip


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class PrometheusExporter:
    """METRICS in a prometheus_client registry of their own (the engine server's /metrics).

    With env PROMETHEUS_MULTIPROC_DIR set (the engine server's API processes under
    `--api-server-count N`: prometheus_client's multiprocess mode), every process writes its
    samples to files there and `render` sums them over all processes: counters and histograms
    add up, a gauge reads its most recent value (every process hears the same engine load and
    config)."""

    def __init__(self, model_name: str):
        import os

        import prometheus_client as pc
        from prometheus_client import values

        pc.disable_created_metrics()  # no `_created` series (vLLM does the same)
        self.registry = pc.CollectorRegistry()
        self.model_name = model_name
        self.multiprocess_dir = os.environ.get(MULTIPROC_ENV) or None
        if self.multiprocess_dir and values.ValueClass is values.MutexValue:
            values.ValueClass = values.MultiProcessValue()  # imported before the variable was set
        kinds = {"counter": pc.Counter, "gauge": pc.Gauge, "histogram": pc.Histogram}
        self._m = {}
        self._children: dict[tuple, object] = {}  # label lookups cost ~5 us: once per series
        for m in METRICS.values():
            extra = {"buckets": m.buckets} if m.buckets else {}
            if m.kind == "gauge" and self.multiprocess_dir:
                extra["multiprocess_mode"] = "mostrecent"
            self._m[m.name] = kinds[m.kind](
                f"{PREFIX}:{m.name}",
                m.doc,
                ("model_name", *m.labels),
                registry=self.registry,
                **extra,
            )

    def _child(self, name: str, labels: dict):
        key = (name, *labels.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._m[name].labels(model_name=self.model_name, **labels)
        return child

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self._child(name, labels).inc(value)

    def set(self, name: str, value: float, **labels: str) -> None:
        self._child(name, labels).set(value)

    def observe(self, name: str, value: float, **labels: str) -> None:
        self._child(name, labels).observe(value)

    def refresh(self) -> None:
        """Nothing to do: prometheus_client keeps every sample until it is changed."""

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        if not self.multiprocess_dir:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.multiprocess_dir)
        return generate_latest(registry), CONTENT_TYPE_LATEST


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
            raise
        finally:
            self.inflight -= 1
            self.totals["requests"] += 1
            self.totals["errors"] += status == "error"
            ex.inc("requests", status=status)

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
