"""Speculation against plain decoding, as ratios, from one run's results.

    python -m ddserve.bench.speedup_report DIR [--base ar@steps4] [--served-base served-ar]

Reads DIR/load*.json (ddserve.bench.engine_load: every config at every level, in-process
runner; with several files a row is named FILE:CONFIG, its base the one of its file if it has
one) and DIR/served-*.json (`ddserve bench` against `ddserve engine`, one file per engine
config), divides each row's output tok/s by the base's at the same concurrency (--base for
the in-process rows, --served-base for the served ones), prints one table, writes
DIR/speedup.json and DIR/speedup.png (tok/s per level, when matplotlib is present). Rows
with errors say so; a ratio is only printed where both sides ran with none.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rows(out: Path, base: str, served_base: str) -> list[dict]:
    found: list[dict] = []
    loads = sorted(out.glob("load*.json"))
    for f in loads:  # a row's config named by its file too where there are several
        for cfg in json.loads(f.read_text())["configs"]:
            label = cfg["config"] if len(loads) == 1 else f"{f.stem}:{cfg['config']}"
            for lv in cfg["levels"]:
                row = {"path": "in-process", "config": label, "base": cfg["config"], "file": f.stem}
                found.append({**row, **_pick(lv)})
    for f in sorted(out.glob("served-*.json")):
        for lv in json.loads(f.read_text())["levels"]:
            found.append({"path": "served", "config": f.stem, **_pick(lv)})
    bases = {("in-process", base), ("served", served_base)}
    ref: dict = {}
    for r in found:  # the base's row at each level: of the same file, else the first
        if (r["path"], r.get("base", r["config"])) in bases:
            ref.setdefault((r["path"], r.get("file"), r["c"]), r)
            ref.setdefault((r["path"], None, r["c"]), r)
    for r in found:
        b = ref.get((r["path"], r.get("file"), r["c"])) or ref.get((r["path"], None, r["c"]))
        clean = b is not None and not b["errors"] and not r["errors"]
        ok = clean and r["tok_s"] is not None and b["tok_s"]
        r["ratio"] = round(r["tok_s"] / b["tok_s"], 3) if ok else None
    return found


def _pick(lv: dict) -> dict:
    return {
        "c": lv["concurrency"],
        "tok_s": lv["output_tok_s"],
        "tau": lv.get("tau_mean"),
        "errors": lv["errors"],
        "requests": lv["requests"],
        "itl_ms_p50": lv.get("itl_ms_p50"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--base", default="ar@steps4", help="in-process config to divide by")
    p.add_argument("--served-base", default="served-ar", help="served result to divide by")
    a = p.parse_args(argv)
    if not a.out.is_dir():
        print(f"speedup_report: {a.out} is not a directory", file=sys.stderr)
        return 2
    found = rows(a.out, a.base, a.served_base)
    if not found:
        print(f"speedup_report: no load*.json or served-*.json in {a.out}", file=sys.stderr)
        return 2
    print(f"{'path':<11} {'config':<46} {'C':>3} {'tok/s':>9} {'ratio':>6} {'tau':>5} errors")
    for r in found:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        print(
            f"{r['path']:<11} {r['config']:<46} {r['c']:>3} {r['tok_s'] or 0:>9.1f} {ratio:>6} "
            f"{tau:>5} {r['errors']}/{r['requests']}"
        )
    report = {"base": a.base, "served_base": a.served_base, "rows": found}
    (a.out / "speedup.json").write_text(json.dumps(report, indent=1) + "\n")
    _plot(found, a.out / "speedup.png")
    return 0


def _plot(found: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    paths = sorted({r["path"] for r in found})
    fig, axes = plt.subplots(1, len(paths), figsize=(6 * len(paths), 4), squeeze=False)
    for ax, name in zip(axes[0], paths, strict=True):
        for cfg in dict.fromkeys(r["config"] for r in found if r["path"] == name):
            pts = [
                (r["c"], r["tok_s"] or 0) for r in found if (r["path"], r["config"]) == (name, cfg)
            ]
            ax.plot(*zip(*pts, strict=True), marker="o", label=cfg)
        ax.set(xscale="log", xlabel="concurrency", ylabel="output tok/s", title=name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
