"""The server's metrics, defined once (`METRICS`), and their Prometheus exporter. Two
exporters of the one definition:

    MeteredBackend(backend, PrometheusExporter(model_name))   the engine server's /metrics
    MeteredBackend(backend, RayExporter(model_name))          a Ray replica (ddserve.serve.metrics)

`MeteredBackend` (ddserve.api.observability) turns request stats into metrics for either.
Names and labels follow vLLM and SGLang: a `ddserve:`
prefix and a `model_name` label (`ddserve:time_to_first_token_seconds`,
`ddserve:spec_decode_num_draft_tokens_total`, ...). Ray names cannot hold ':' and get a
`ray_` prefix, so a replica's `ddserve_x` is scraped as `ray_ddserve_x`; the scrape config
(deploy/prometheus.yml) renames it back to `ddserve:x`, and one dashboard reads both.
"""

from __future__ import annotations

from dataclasses import dataclass

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
