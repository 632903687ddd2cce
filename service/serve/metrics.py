"""Per-replica metrics on Ray: the metrics of ddserve.api.prometheus, exported through
Ray Serve's metrics API.

Ray names cannot hold ':', so `ddserve:x` is registered as `ddserve_x`; Ray's metrics agent
on every node serves it as `ray_ddserve_x` with the labels `application`, `deployment`,
`replica` (added by Serve) plus ours (`model_name`, ...). deploy/prometheus.yml renames
`ray_ddserve_x` back to `ddserve:x` at scrape time (metric_relabel_configs), so the bare
engine's /metrics and the replicas land under the same names and one dashboard reads both.
Prometheus finds every node's agent through Ray's service-discovery file.

The engine's own gauges (running and waiting requests, KV slots) live in the engine
process; the replica reads them from the engine's /metrics (builtin) or SGLang's, and
re-exports them with its replica label (`poll_engine_load`).
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families
from ray.serve import metrics

from ddserve.api.prometheus import LOAD_GAUGES, METRICS, PREFIX

# SGLang's names for the same gauges (its server runs with --enable-metrics)
SGLANG_LOAD = {
    "sglang:num_running_reqs": "num_requests_running",
    "sglang:num_queue_reqs": "num_requests_waiting",
}


class RayExporter:
    """METRICS as Ray Serve metrics (tag `model_name` on every one). Ray drops a gauge
    sample that is not refreshed within two export intervals: `refresh` re-sets them."""

    def __init__(self, model_name: str):
        kinds = {"counter": metrics.Counter, "gauge": metrics.Gauge, "histogram": metrics.Histogram}
        self._m = {}
        for m in METRICS.values():
            extra = {"boundaries": list(m.buckets)} if m.buckets else {}
            metric = kinds[m.kind](
                f"{PREFIX}_{m.name}", description=m.doc, tag_keys=("model_name", *m.labels), **extra
            )
            metric.set_default_tags({"model_name": model_name})
            self._m[m.name] = metric
        self._gauges: dict[tuple[str, tuple], float] = {}

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        if value > 0:  # Ray refuses 0
            self._m[name].inc(value, tags=labels)

    def set(self, name: str, value: float, **labels: str) -> None:
        self._m[name].set(value, tags=labels)
        self._gauges[(name, tuple(sorted(labels.items())))] = value

    def observe(self, name: str, value: float, **labels: str) -> None:
        self._m[name].observe(value, tags=labels)

    def refresh(self) -> None:
        for (name, labels), value in self._gauges.items():
            self._m[name].set(value, tags=dict(labels))


def parse_engine_load(text: str) -> dict:
    """LOAD_GAUGES from an engine's Prometheus text (ddserve's names, or SGLang's)."""
    out: dict = {}
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix(f"{PREFIX}:")
        name = SGLANG_LOAD.get(family.name, name)
        if name in LOAD_GAUGES and family.samples:
            out[name] = sum(s.value for s in family.samples)
    return out


async def poll_engine_load(client: httpx.AsyncClient, engine_url: str) -> dict:
    """The engine's load gauges, or {} when its /metrics does not answer (SGLang without
    --enable-metrics, an engine restarting): the replica then exports none."""
    try:
        r = await client.get(engine_url.rstrip("/") + "/metrics", timeout=0.5)
    except httpx.HTTPError:
        return {}
    return parse_engine_load(r.text) if r.status_code == 200 else {}
