"""The table of bench/serving_path.sh: every path next to the in-process runner, as ratios.

    python -m ddserve.bench.serving_path_report OUT

Reads OUT/inproc.json (ddserve.bench.engine_load) and OUT/<path>-<config>/bench.json
(`ddserve bench`; http-asc: with --api-server-count; http-ref: the engine server of another checkout; ray-asc: a replica with api_server_count), OUT/<path>-<config>-C<level>/bench.json (one per level) or
OUT/<path>-<config>.json (a copied result), prints one table (tok/s, ratio to in-process, TTFT and ITL p50/p99,
client CPU where the load generator reports it) and, for a speculative config, its ratio to AR
(b0) on the same path at the same level; writes OUT/serving_path.json and .png.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# b15k4: the shipped GPU config's ceiling (http-deploy, ray-deploy: adaptive speculation)
CONFIGS = {"b16k4": "dflash-b16k4", "b15k4": "dflash-b15k4", "b0": "dflash-b0"}
PATHS = ["http", "http-asc", "http-ref", "ray-proxy", "ray-haproxy", "ray-asc"]
PATHS += ["http-deploy", "ray-deploy"]
KEYS = ("output_tok_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")


def load(out: Path) -> list[dict]:
    rows = []
    inproc = json.loads((out / "inproc.json").read_text()) if (out / "inproc.json").exists() else {}
    base: dict = {}
    for cfg in inproc.get("configs", []):
        for lv in cfg["levels"]:
            base[(cfg["config"], lv["concurrency"])] = lv
            rows.append({"path": "inproc", "config": cfg["config"], **_pick(lv)})
    for path in PATHS:
        for short, name in CONFIGS.items():
            files = sorted(out.glob(f"{path}-{short}-C*/bench.json"))  # one run per level
            files += [
                f
                for f in (out / f"{path}-{short}" / "bench.json", out / f"{path}-{short}.json")
                if f.exists()
            ]
            levels = [lv for f in files for lv in json.loads(f.read_text())["levels"]]
            for lv in sorted(levels, key=lambda lv: lv["concurrency"]):
                row = {"path": path, "config": name, **_pick(lv)}
                ref = base.get((name, lv["concurrency"]))
                if ref and ref.get("output_tok_s"):
                    row["vs_inproc"] = round(lv["output_tok_s"] / ref["output_tok_s"], 3)
                    row["ttft_p50_minus_inproc_ms"] = round(
                        lv["ttft_ms_p50"] - ref["ttft_ms_p50"], 1
                    )
                    if ref.get("itl_ms_p99"):
                        row["itl_p99_vs_inproc"] = round(lv["itl_ms_p99"] / ref["itl_ms_p99"], 2)
                rows.append(row)
    ar = {(r["path"], r["concurrency"]): r for r in rows if r["config"] == CONFIGS["b0"]}
    for r in rows:
        ref = ar.get((r["path"], r["concurrency"]))
        if r["config"] != CONFIGS["b0"] and ref and ref.get("output_tok_s"):
            r["vs_ar"] = round(r["output_tok_s"] / ref["output_tok_s"], 3)
    return rows


def _pick(lv: dict) -> dict:
    row = {"concurrency": lv["concurrency"], "errors": lv.get("errors", 0)}
    row |= {k: lv.get(k) for k in KEYS}
    cpu = lv.get("client_cpu") or {}
    if cpu:
        row["client_cpu"] = cpu.get("total", cpu)
    return row


def _ratio(x: float | None, width: int) -> str:
    return f"{x:{width}.2f}" if x is not None else "-".rjust(width)


def main() -> None:
    out = Path(sys.argv[1])
    rows = load(out)
    print(
        f"{'path':12s} {'config':13s} {'C':>4s} {'tok/s':>9s} {'x inproc':>8s} {'x AR':>5s} {'TTFT p50':>9s} {'p99':>7s} {'ITL p50':>8s} {'p99':>7s} {'err':>4s}"
    )
    for r in rows:
        print(
            f"{r['path']:12s} {r['config']:13s} {r['concurrency']:4d} {r['output_tok_s'] or 0:9.1f} "
            f"{_ratio(r.get('vs_inproc'), 8)} {_ratio(r.get('vs_ar'), 5)} {r['ttft_ms_p50'] or 0:9.1f} {r['ttft_ms_p99'] or 0:7.1f} "
            f"{r['itl_ms_p50'] or 0:8.2f} {r['itl_ms_p99'] or 0:7.2f} {r['errors']:4d}"
        )
    (out / "serving_path.json").write_text(json.dumps({"rows": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    present = [c for c in CONFIGS.values() if any(r["config"] == c for r in rows)]
    if not present:  # every leg failed: the table and JSON say so, no plot
        return
    fig, axes = plt.subplots(1, len(present), figsize=(5.5 * len(present), 4), squeeze=False)
    for ax, cfg in zip(axes[0], present, strict=True):
        for path in ["inproc", *PATHS]:
            pts = [
                (r["concurrency"], r["output_tok_s"])
                for r in rows
                if r["path"] == path and r["config"] == cfg
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", label=path)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tok/s")
        ax.set_title(cfg)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "serving_path.png", dpi=100)


if __name__ == "__main__":
    main()
