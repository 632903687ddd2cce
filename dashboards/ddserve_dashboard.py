"""The ddserve Grafana dashboard, as code. `python -m ddserve.dashboards.ddserve_dashboard` rewrites
dashboards/ddserve.json (committed). Speculation panels come first.

Every query reads the replicas' metrics as Prometheus sees them (Ray's `ray_` prefix, label
`replica`); `$replica` filters, `$__rate_interval`/`$__range` are Grafana's.
"""

from __future__ import annotations

import json
from pathlib import Path

from grafanalib._gen import DashboardEncoder
from grafanalib.core import (
    BarGauge,
    Dashboard,
    GridPos,
    Table,
    Target,
    Template,
    Templating,
    TimeSeries,
)

SEL = 'replica=~"$replica"'
RATE = "[$__rate_interval]"


def _q(name: str, le_q: float) -> str:
    return f"histogram_quantile({le_q}, sum by (le) (rate({name}_bucket{{{SEL}}}{RATE})))"


# (title, unit, [(legend, expr)], kind)
PANELS: list[tuple[str, str, list[tuple[str, str]], str]] = [
    (
        "Acceptance length (mean) per replica",
        "none",
        [
            (
                "{{replica}}",
                f"sum by (replica) (rate(ray_ddserve_accept_length_sum{{{SEL}}}{RATE})) / sum by (replica) (rate(ray_ddserve_accept_length_count{{{SEL}}}{RATE}))",
            ),
        ],
        "timeseries",
    ),
    (
        "Acceptance length p50 / p90",
        "none",
        [
            ("p50", _q("ray_ddserve_accept_length", 0.5)),
            ("p90", _q("ray_ddserve_accept_length", 0.9)),
        ],
        "timeseries",
    ),
    (
        "Acceptance length distribution (tokens per verify round)",
        "none",
        [
            (
                "<= {{le}}",
                f"sum by (le) (increase(ray_ddserve_accept_length_bucket{{{SEL}}}[$__range]))",
            ),
        ],
        "bargauge",
    ),
    (
        "Output tokens/s per replica and total",
        "short",
        [
            (
                "{{replica}}",
                f"sum by (replica) (rate(ray_ddserve_generation_tokens_total{{{SEL}}}{RATE}))",
            ),
            ("total", f"sum(rate(ray_ddserve_generation_tokens_total{{{SEL}}}{RATE}))"),
        ],
        "timeseries",
    ),
    (
        "Time to first token p50 / p99",
        "s",
        [
            ("p50", _q("ray_ddserve_time_to_first_token_seconds", 0.5)),
            ("p99", _q("ray_ddserve_time_to_first_token_seconds", 0.99)),
        ],
        "timeseries",
    ),
    (
        "Inter-token latency p50 / p99",
        "s",
        [
            ("p50", _q("ray_ddserve_inter_token_latency_seconds", 0.5)),
            ("p99", _q("ray_ddserve_inter_token_latency_seconds", 0.99)),
        ],
        "timeseries",
    ),
    (
        "Requests/s by status",
        "reqps",
        [
            ("{{status}}", f"sum by (status) (rate(ray_ddserve_requests_total{{{SEL}}}{RATE}))"),
        ],
        "timeseries",
    ),
    (
        "In-flight and queued requests",
        "short",
        [
            ("in flight {{replica}}", f"sum by (replica) (ray_ddserve_inflight_requests{{{SEL}}})"),
            # queued in Serve's router before a replica is chosen: per deployment, not replica
            (
                "queued (Serve)",
                'sum(ray_serve_deployment_queued_queries{deployment="EngineReplica"})',
            ),
        ],
        "timeseries",
    ),
    (
        "Live config per replica",
        "none",
        [
            (
                "",
                f"max by (replica, fingerprint, engine, budget, topk, window, temperature, top_p, top_k) (ray_ddserve_config_info{{{SEL}}} == 1)",
            ),
        ],
        "table",
    ),
    (
        "Reconfigurations by result",
        "short",
        [
            (
                "{{result}}",
                f"sum by (result) (increase(ray_ddserve_reconfigurations_total{{{SEL}}}[$__range]))",
            ),
        ],
        "bargauge",
    ),
]


def build() -> Dashboard:
    panels = []
    for i, (title, unit, queries, kind) in enumerate(PANELS):
        targets = [
            Target(expr=expr, legendFormat=legend, refId=chr(65 + j))
            for j, (legend, expr) in enumerate(queries)
        ]
        pos = GridPos(h=8, w=12, x=12 * (i % 2), y=8 * (i // 2))
        if kind == "table":
            targets = [Target(expr=queries[0][1], refId="A", format="table", instant=True)]
            panels.append(
                Table(title=title, dataSource="${datasource}", targets=targets, gridPos=pos)
            )
        elif kind == "bargauge":
            panels.append(
                BarGauge(
                    title=title,
                    dataSource="${datasource}",
                    targets=targets,
                    gridPos=pos,
                    format=unit,
                    calc="lastNotNull",
                )
            )
        else:
            panels.append(
                TimeSeries(
                    title=title, dataSource="${datasource}", targets=targets, gridPos=pos, unit=unit
                )
            )
    return Dashboard(
        title="ddserve: DDTree speculative decoding",
        uid="ddserve-main",
        tags=["ddserve", "ray-serve", "speculative-decoding"],
        timezone="browser",
        refresh="10s",
        panels=panels,
        templating=Templating(
            list=[
                Template(
                    name="datasource", type="datasource", query="prometheus", label="Data source"
                ),
                Template(
                    name="replica",
                    label="Replica",
                    dataSource="${datasource}",
                    query="label_values(ray_ddserve_requests_total, replica)",
                    includeAll=True,
                    multi=True,
                    default="$__all",
                ),
            ]
        ),
    ).auto_panel_ids()


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query, for checks against a real Prometheus."""
    return [(title, expr) for title, _, queries, _ in PANELS for _, expr in queries]


def to_json() -> str:
    return json.dumps(build().to_json_data(), cls=DashboardEncoder, indent=2, sort_keys=True) + "\n"


def main() -> None:
    out = Path(__file__).with_name("ddserve.json")
    out.write_text(to_json())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
