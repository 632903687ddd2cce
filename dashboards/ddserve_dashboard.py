"""The ddserve Grafana dashboard, as code (grafana-foundation-sdk, Grafana's own builder
library: current schema, datasource references as objects).

    python -m ddserve.dashboards.ddserve_dashboard    rewrites dashboards/ddserve.json (committed)

One dashboard for both deployments: the bare engine's /metrics and the Ray replicas share
the `ddserve:` names (deploy/prometheus.yml renames Ray's `ray_ddserve_*` at scrape time and
gives a bare engine's series a `replica` label: its address). Variables: `$datasource`,
`$application` (Ray's Serve application; bare engines have none), `$model` (`model_name`),
`$replica`. "All" is `.*`, which also matches a series without the label. Speculation
panels come first; the Serve router queue is the one panel only Ray has.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, common, dashboard, prometheus, table
from grafana_foundation_sdk.builders import timeseries as ts
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import BarGaugeDisplayMode
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

SEL = 'application=~"$application", model_name=~"$model", replica=~"$replica"'
RATE = "[$__rate_interval]"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")


def _rate(name: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({name}{{{SEL}}}{RATE}))"


def _q(name: str, le_q: float) -> str:
    return f"histogram_quantile({le_q}, sum by (le) (rate({name}_bucket{{{SEL}}}{RATE})))"


@dataclass(frozen=True)
class Panel:
    row: str
    title: str
    unit: str
    queries: list[tuple[str, str]]  # (legend, PromQL with Grafana's variables)
    kind: str = "timeseries"  # timeseries | bargauge | table
    ray_only: bool = False  # a metric of Ray Serve itself: no bare-engine equivalent


SPEC, SPEED, LOAD, CONFIG = "Speculative decoding", "Throughput and latency", "Load", "Config"

PANELS: list[Panel] = [
    Panel(
        SPEC,
        "Acceptance length (tau) per replica",
        "none",
        [
            (
                "{{replica}}",
                f"{_rate('ddserve:accept_length_sum', 'replica')} / {_rate('ddserve:accept_length_count', 'replica')}",
            )
        ],
    ),
    Panel(
        SPEC,
        "Draft acceptance rate per replica (accepted / drafted tokens)",
        "percentunit",
        [
            (
                "{{replica}}",
                # Ray exports a counter once it is above 0: none accepted yet reads as 0
                f"({_rate('ddserve:spec_decode_num_accepted_tokens_total', 'replica')} or {_rate('ddserve:spec_decode_num_draft_tokens_total', 'replica')} * 0) / {_rate('ddserve:spec_decode_num_draft_tokens_total', 'replica')}",
            )
        ],
    ),
    Panel(
        SPEC,
        "Acceptance per draft position (share of drafts accepted that deep)",
        "percentunit",
        [
            (
                "position {{position}}",
                f'({_rate("ddserve:spec_decode_num_accepted_tokens_per_pos_total", "position")} or label_replace({_rate("ddserve:spec_decode_num_drafts_total")} * 0, "position", "0", "", "")) / ignoring(position) group_left() {_rate("ddserve:spec_decode_num_drafts_total")}',
            )
        ],
    ),
    Panel(
        SPEC,
        "Draft budget of the last round per replica (below the live budget: adaptive or crowded)",
        "none",
        [("{{replica}}", f"max by (replica) (ddserve:spec_budget{{{SEL}}})")],
    ),
    Panel(
        SPEC,
        "Acceptance length p50 / p90",
        "none",
        [("p50", _q("ddserve:accept_length", 0.5)), ("p90", _q("ddserve:accept_length", 0.9))],
    ),
    Panel(
        SPEC,
        "Acceptance length distribution (tokens per verify round)",
        "none",
        [
            (
                "<= {{le}}",
                f"sum by (le) (increase(ddserve:accept_length_bucket{{{SEL}}}[$__range]))",
            )
        ],
        "bargauge",
    ),
    Panel(
        SPEED,
        "Output tokens/s per replica and total",
        "short",
        [
            ("{{replica}}", _rate("ddserve:generation_tokens_total", "replica")),
            ("total", _rate("ddserve:generation_tokens_total")),
        ],
    ),
    Panel(
        SPEED,
        "Time to first token p50 / p99",
        "s",
        [
            ("p50", _q("ddserve:time_to_first_token_seconds", 0.5)),
            ("p99", _q("ddserve:time_to_first_token_seconds", 0.99)),
        ],
    ),
    Panel(
        SPEED,
        "Time to first token p50: the engine's queue and prefill phases",
        "s",
        [
            ("server TTFT", _q("ddserve:time_to_first_token_seconds", 0.5)),
            ("queue", _q("ddserve:request_queue_time_seconds", 0.5)),
            ("prefill", _q("ddserve:request_prefill_time_seconds", 0.5)),
        ],
    ),
    Panel(
        SPEED,
        "Inter-token latency p50 / p99",
        "s",
        [
            ("p50", _q("ddserve:inter_token_latency_seconds", 0.5)),
            ("p99", _q("ddserve:inter_token_latency_seconds", 0.99)),
        ],
    ),
    Panel(
        SPEED,
        "End-to-end request latency p50 / p99",
        "s",
        [
            ("p50", _q("ddserve:e2e_request_latency_seconds", 0.5)),
            ("p99", _q("ddserve:e2e_request_latency_seconds", 0.99)),
        ],
    ),
    Panel(
        SPEED,
        "Requests/s by status",
        "reqps",
        [("{{status}}", _rate("ddserve:requests_total", "status"))],
    ),
    Panel(
        LOAD,
        "Running and waiting requests per replica",
        "short",
        [
            ("running {{replica}}", f"sum by (replica) (ddserve:num_requests_running{{{SEL}}})"),
            ("waiting {{replica}}", f"sum by (replica) (ddserve:num_requests_waiting{{{SEL}}})"),
        ],
    ),
    Panel(
        LOAD,
        "KV cache slots used per replica",
        "short",
        [("{{replica}}", f"sum by (replica) (ddserve:kv_slots_used{{{SEL}}})")],
    ),
    Panel(
        LOAD,
        "Prompt tokens a round may prefill while others decode (paced; 0 = no limit)",
        "short",
        [("{{replica}}", f"max by (replica) (ddserve:prefill_chunk_tokens{{{SEL}}})")],
    ),
    Panel(
        LOAD,
        "Queued in Ray Serve's router (before a replica is chosen)",
        "short",
        [
            (
                "{{application}}",
                'sum by (application) (ray_serve_deployment_queued_queries{application=~"$application"})',
            )
        ],
        ray_only=True,
    ),
    Panel(
        CONFIG,
        "Live config per replica",
        "none",
        [
            (
                "",
                f"max by (replica, model_name, fingerprint, engine, budget, topk, window, temperature, top_p, top_k) (ddserve:config_info{{{SEL}}} == 1)",
            )
        ],
        "table",
    ),
    Panel(
        CONFIG,
        "Reconfigurations by result",
        "short",
        [
            (
                "{{result}}",
                f"sum by (result) (increase(ddserve:reconfigurations_total{{{SEL}}}[$__range]))",
            )
        ],
        "bargauge",
    ),
]

# (name, label, label_values query)
VARIABLES = [
    ("application", "Application", "label_values(ddserve:config_info, application)"),
    (
        "model",
        "Model",
        'label_values(ddserve:config_info{application=~"$application"}, model_name)',
    ),
    (
        "replica",
        "Replica",
        'label_values(ddserve:config_info{application=~"$application", model_name=~"$model"}, replica)',
    ),
]


def _targets(p: Panel) -> list[prometheus.Dataquery]:
    out = []
    for j, (legend, expr) in enumerate(p.queries):
        q = prometheus.Dataquery().expr(expr).ref_id(chr(65 + j)).datasource(DATASOURCE)
        if p.kind == "table":
            q = q.format(PromQueryFormat.TABLE).instant()
        elif legend:
            q = q.legend_format(legend)
        out.append(q)
    return out


def _panel(p: Panel):
    if p.kind == "table":
        b = table.Panel()
    elif p.kind == "bargauge":
        b = (
            bargauge.Panel()
            .display_mode(BarGaugeDisplayMode.GRADIENT)
            .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]))
        )
    else:
        b = ts.Panel().line_width(1).fill_opacity(10)
    b = b.title(p.title).datasource(DATASOURCE).unit(p.unit).height(8).span(12)
    for t in _targets(p):
        b = b.with_target(t)
    return b


def build():
    d = (
        dashboard.Dashboard("ddserve: DDTree speculative decoding")
        .uid("ddserve-main")
        .tags(["ddserve", "ray-serve", "speculative-decoding"])
        .timezone("browser")
        .refresh("10s")
        .time("now-30m", "now")
        .with_variable(
            dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
    )
    for name, label, query in VARIABLES:
        d = d.with_variable(
            dashboard.QueryVariable(name)
            .label(label)
            .datasource(DATASOURCE)
            .query(query)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .include_all(True)
            .all_value(".*")
            .multi(True)
        )
    row = None
    for p in PANELS:
        if p.row != row:
            d, row = d.with_row(dashboard.Row(p.row)), p.row
        d = d.with_panel(_panel(p))
    return d.build()


def panel_queries(ray: bool = True) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query, for checks against a real Prometheus;
    `ray=False` leaves out the panels only a Ray deployment has data for."""
    return [(p.title, e) for p in PANELS if ray or not p.ray_only for _, e in p.queries]


def variable_queries() -> list[tuple[str, str]]:
    """(variable, PromQL) giving each variable's values: `label_values(expr, label)` as
    `group by (label) (expr)`."""
    out = []
    for name, _, query in VARIABLES:
        expr, label = query.removeprefix("label_values(").removesuffix(")").rsplit(",", 1)
        out.append((name, f"group by ({label.strip()}) ({expr})"))
    return out


def to_json() -> str:
    return json.dumps(build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main() -> None:
    out = Path(__file__).with_name("ddserve.json")
    out.write_text(to_json())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
