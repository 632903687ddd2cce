"""Render the dashboard's main panels from a real Prometheus to one PNG (matplotlib), so a
reader sees what the Grafana dashboard shows without Grafana.

    python -m ddserve.dashboards.render_png --prometheus http://127.0.0.1:9090 --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import time

import httpx

from ddserve.dashboards.ddserve_dashboard import PANELS

# the panels drawn, by title (indices moved as panels were added: 5 and 9 had become the
# acceptance histogram and the end-to-end latency)
MAIN_TITLES = (
    "Acceptance length (tau)",
    "Output tokens/s",
    "Time to first token",
    "Requests/s by status",
)
MAIN = [next(i for i, p in enumerate(PANELS) if p.title.startswith(t)) for t in MAIN_TITLES]


def grafana_to_promql(expr: str, rate_window: str = "15s", range_window: str = "10m") -> str:
    return (
        expr.replace("$__rate_interval", rate_window)
        .replace("$__range", range_window)
        .replace("$application", ".*")
        .replace("$model", ".*")
        .replace("$replica", ".*")
    )


def render(prometheus: str, out: str, minutes: float = 5.0, step: float = 2.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = time.time()
    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    for ax, idx in zip(axes.flat, MAIN, strict=True):
        p = PANELS[idx]
        title, unit = p.title, p.unit
        for legend, expr in p.queries:
            r = httpx.get(
                f"{prometheus}/api/v1/query_range",
                params={
                    "query": grafana_to_promql(expr),
                    "start": end - 60 * minutes,
                    "end": end,
                    "step": step,
                },
                timeout=30,
            ).json()
            for series in r["data"]["result"]:
                xs = [float(t) - end for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                label = legend
                for k, v in series["metric"].items():
                    label = label.replace("{{" + k + "}}", v)
                ax.plot(xs, ys, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seconds before now")
        ax.set_ylabel(unit)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle("ddserve dashboard (main panels), rendered from Prometheus")
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prometheus", default="http://127.0.0.1:9090")
    ap.add_argument("--out", default="docs/dashboard.png")
    ap.add_argument("--minutes", type=float, default=5.0)
    a = ap.parse_args()
    render(a.prometheus, a.out, a.minutes)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
