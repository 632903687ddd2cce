"""The table of bench/stream_interval.sh: each path at each --stream-interval, next to its own
interval-1 leg, as ratios.

    python -m ddserve.bench.stream_interval_report OUT

Reads OUT/<path>-i<N>/bench.json (`ddserve bench`) and OUT/<path>-i<N>/cpu.json (the machine's
busy CPU over that bench), prints one table (tok/s and its ratio to interval 1, TTFT p50, ITL
p50/p99 as `ddserve bench` reads it (each chunk gap spread over the tokens of a chunk), machine
CPU per output token and its ratio), writes OUT/stream_interval.json and .png.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

KEYS = ("output_tok_s", "ttft_ms_p50", "itl_ms_p50", "itl_ms_p99", "errors", "output_tokens")


def load(out: Path) -> list[dict]:
    rows = []
    for f in sorted(out.glob("*-i*/bench.json")):
        m = re.fullmatch(r"(.+)-i(\d+)", f.parent.name)
        if not m:
            continue
        lv = json.loads(f.read_text())["levels"]
        lv = lv[0] if isinstance(lv, list) else lv
        row = {"path": m.group(1), "interval": int(m.group(2)), "concurrency": lv["concurrency"]}
        row |= {k: lv.get(k) for k in KEYS}
        cpu_file = f.parent / "cpu.json"
        if cpu_file.exists() and row["output_tokens"]:
            cpu = json.loads(cpu_file.read_text())
            cpu_s = cpu["busy_jiffies"] / cpu["hz"]
            row["machine_cpu_us_per_token"] = round(cpu_s / row["output_tokens"] * 1e6, 1)
        rows.append(row)
    rows.sort(key=lambda r: (r["path"], r["interval"]))
    for r in rows:
        base = next((b for b in rows if b["path"] == r["path"] and b["interval"] == 1), None)
        if base and base.get("output_tok_s"):
            r["tok_s_vs_interval1"] = round(r["output_tok_s"] / base["output_tok_s"], 3)
        if base and base.get("machine_cpu_us_per_token") and r.get("machine_cpu_us_per_token"):
            r["cpu_vs_interval1"] = round(
                r["machine_cpu_us_per_token"] / base["machine_cpu_us_per_token"], 3
            )
    return rows


def main() -> None:
    out = Path(sys.argv[1])
    rows = load(out)
    print(
        f"{'path':6s} {'N':>3s} {'C':>4s} {'tok/s':>8s} {'x N=1':>6s} {'TTFT p50':>9s} "
        f"{'ITL p50':>8s} {'p99':>7s} {'CPU us/tok':>11s} {'x N=1':>6s} {'err':>4s}"
    )
    for r in rows:
        print(
            f"{r['path']:6s} {r['interval']:3d} {r['concurrency']:4d} {r['output_tok_s'] or 0:8.1f} "
            f"{r.get('tok_s_vs_interval1', 1.0):6.3f} {r['ttft_ms_p50'] or 0:9.1f} "
            f"{r['itl_ms_p50'] or 0:8.2f} {r['itl_ms_p99'] or 0:7.2f} "
            f"{r.get('machine_cpu_us_per_token', 0):11.1f} {r.get('cpu_vs_interval1', 1.0):6.3f} "
            f"{r['errors'] or 0:4d}"
        )
    (out / "stream_interval.json").write_text(json.dumps({"rows": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    paths = sorted({r["path"] for r in rows})
    for ax, key, label in (
        (axes[0], "output_tok_s", "output tok/s"),
        (axes[1], "machine_cpu_us_per_token", "machine CPU per output token (us)"),
    ):
        for i, path in enumerate(paths):
            pts = [r for r in rows if r["path"] == path]
            xs = [j + i * 0.4 for j in range(len(pts))]
            ax.bar(xs, [r.get(key) or 0 for r in pts], width=0.38, label=path)
            for x, r in zip(xs, pts, strict=True):
                ax.text(x, 0, f"N={r['interval']}", ha="center", va="bottom", fontsize=8)
        ax.set_ylabel(label)
        ax.set_xticks([])
        ax.legend()
    fig.suptitle("--stream-interval N (same engine, same load)")
    fig.tight_layout()
    fig.savefig(out / "stream_interval.png", dpi=100)


if __name__ == "__main__":
    main()
