"""Per-replica Prometheus metrics, through Ray Serve's metrics API.

Ray exports them from every node's metrics agent with the `ray_` prefix and the labels
`application`, `deployment`, `replica` (added by Serve) plus ours. Prometheus finds every
node's agent through Ray's service-discovery file (deploy/prometheus.yml). Metric names and
meanings are listed in the README ("Metrics").
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from ray.serve import metrics

from ddserve.api.generation import Delta
from ddserve.engine.sampling import SamplingParams
from ddserve.errors import DDServeError

LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5, 10, 20, 40, 80]
# Ray's exporter rebuilds a histogram's _sum from bucket midpoints, so acceptance-length
# buckets are centred on the integers: every length up to 16 keeps an exact mean.
ACCEPT_BUCKETS = [k + 0.5 for k in range(17)] + [24.5, 32.5, 64.5]


class ReplicaMetrics:
    def __init__(self) -> None:
        self.accept_length = metrics.Histogram(
            "ddserve_accept_length",
            description="Tokens committed per verify round (acceptance length, tau).",
            boundaries=ACCEPT_BUCKETS,
        )
        self.generation_tokens = metrics.Counter(
            "ddserve_generation_tokens", description="Completion tokens generated."
        )
        self.prompt_tokens = metrics.Counter(
            "ddserve_prompt_tokens", description="Prompt tokens processed."
        )
        self.verify_rounds = metrics.Counter(
            "ddserve_verify_rounds", description="Target verify forwards (decoding rounds)."
        )
        self.ttft = metrics.Histogram(
            "ddserve_time_to_first_token_seconds",
            description="Request arrival at the replica to its first generated text.",
            boundaries=LATENCY_BUCKETS,
        )
        self.itl = metrics.Histogram(
            "ddserve_inter_token_latency_seconds",
            description="Time between streamed tokens (per token).",
            boundaries=LATENCY_BUCKETS,
        )
        self.e2e = metrics.Histogram(
            "ddserve_e2e_request_latency_seconds",
            description="Request arrival to its last token.",
            boundaries=LATENCY_BUCKETS,
        )
        self.requests = metrics.Counter(
            "ddserve_requests", description="Finished requests by status.", tag_keys=("status",)
        )
        self.inflight = metrics.Gauge(
            "ddserve_inflight_requests", description="Requests being generated on this replica."
        )
        self.config_info = metrics.Gauge(
            "ddserve_config_info",
            description="1 for the live config of this replica (labels), 0 for configs it left.",
            tag_keys=(
                "fingerprint",
                "engine",
                "model",
                "budget",
                "topk",
                "window",
                "temperature",
                "top_p",
                "top_k",
            ),
        )
        self.reconfigurations = metrics.Counter(
            "ddserve_reconfigurations",
            description="Reconfigurations applied to this replica, by result.",
            tag_keys=("result",),
        )
        self.reconfigure_seconds = metrics.Histogram(
            "ddserve_reconfigure_duration_seconds",
            description="Time to apply and verify a live reconfiguration on this replica.",
            boundaries=LATENCY_BUCKETS,
        )
        self._inflight = 0
        self._config_tags: dict | None = None

    def set_config(self, engine: str, model: str, fingerprint: str, params: dict) -> None:
        tags = {
            "fingerprint": fingerprint,
            "engine": engine,
            "model": model,
            **{
                k: str(params[k])
                for k in ("budget", "topk", "window", "temperature", "top_p", "top_k")
            },
        }
        if self._config_tags and self._config_tags != tags:
            self.config_info.set(0.0, tags=self._config_tags)
        self.config_info.set(1.0, tags=tags)
        self._config_tags = tags

    def reconfigured(self, ok: bool, seconds: float) -> None:
        self.reconfigurations.inc(tags={"result": "applied" if ok else "failed"})
        self.reconfigure_seconds.observe(seconds)

    def refresh(self) -> None:
        """Re-set the gauges. Ray drops a gauge sample that is not refreshed within two
        export intervals, so the replica calls this periodically."""
        if self._config_tags:
            self.config_info.set(1.0, tags=self._config_tags)
        self.inflight.set(float(self._inflight))

    def _adjust_inflight(self, d: int) -> None:
        self._inflight += d
        self.inflight.set(float(self._inflight))


class MeteredBackend:
    """Wraps a backend; records per-request metrics around `stream`."""

    def __init__(self, inner, m: ReplicaMetrics):
        self.inner = inner
        self.m = m
        self._publish_config()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _publish_config(self) -> None:
        i = self.inner
        self.m.set_config(i.kind, i.model_id, i.fingerprint, i.params.model_dump())

    async def update_params(self, changes: dict) -> dict:
        result = await self.inner.update_params(changes)
        self._publish_config()
        return result

    async def refresh(self) -> None:
        await self.inner.refresh()
        self._publish_config()

    async def stream(self, prompt: list[int], sampling: SamplingParams) -> AsyncIterator[Delta]:
        m = self.m
        t0 = last = time.perf_counter()
        first, status = True, "cancelled"
        m._adjust_inflight(1)
        try:
            async for d in self.inner.stream(prompt, sampling):
                now = time.perf_counter()
                n = max(len(d.token_ids), 1 if d.text else 0)
                if first and (d.text or d.token_ids):
                    m.ttft.observe(now - t0)
                    first = False
                elif n:
                    gap = (now - last) / n
                    for _ in range(n):
                        m.itl.observe(gap)
                if n:
                    last = now
                if d.finish_reason is not None:
                    self._record_finish(d, prompt, now - t0)
                    status = "ok"
                yield d
        except DDServeError as exc:
            status = "client_error" if exc.status_code < 500 else "error"
            raise
        finally:
            m._adjust_inflight(-1)
            m.requests.inc(tags={"status": status})

    def _record_finish(self, d: Delta, prompt: list[int], e2e: float) -> None:
        m, st = self.m, d.stats
        m.e2e.observe(e2e)
        m.prompt_tokens.inc(len(prompt))
        if st is None:
            return
        if st.completion_tokens:
            m.generation_tokens.inc(st.completion_tokens)
        if st.verify_rounds:
            m.verify_rounds.inc(st.verify_rounds)
        # per-round lengths when the engine reports them (builtin), else the request's mean
        for n in st.accept_lengths or [st.tau] * st.verify_rounds:
            m.accept_length.observe(n)
