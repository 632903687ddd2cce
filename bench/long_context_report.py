"""The table, JSON and PNG of a bench/long_context.sh run (issue 18).

    python -m ddserve.bench.long_context_report OUT

Reads OUT/{before,after}-pN/bench.json and OUT/{before,after}-admission.json; writes
OUT/long_context.json (rows + the issue's ratios) and OUT/long_context.png, prints a
markdown table.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def load(out: Path) -> dict:
    rows = []
    for f in sorted(out.glob("*-p*/bench.json")):
        part, n = re.match(r"(\w+)-p(\d+)$", f.parent.name).groups()
        for lv in json.loads(f.read_text())["levels"]:
            rows.append(
                {
                    "part": part,
                    "prompt": int(n),
                    "prompt_tokens_mean": lv.get("prompt_tokens_mean"),
                    "concurrency": lv["concurrency"],
                    "tok_s": lv["output_tok_s"],
                    "ttft_ms_p50": lv["ttft_ms_p50"],
                    "ttft_ms_p99": lv["ttft_ms_p99"],
                    "itl_ms_p50": lv["itl_ms_p50"],
                    "itl_ms_p99": lv["itl_ms_p99"],
                    "errors": lv["errors"],
                    "client_cores": lv["client_cpu"]["cores"],
                }
            )
    adm = {}
    for part in ("before", "after"):
        f = out / f"{part}-admission.json"
        if f.exists():
            adm[part] = json.loads(f.read_text())
    return {"rows": rows, "admission": adm}


def ratios(res: dict) -> dict:
    """The issue's figures, per part: 7k vs shortest at C=1, 3k vs shortest at C=16, TTFT."""
    out = {}
    for part in ("before", "after"):
        by = {(r["prompt"], r["concurrency"]): r for r in res["rows"] if r["part"] == part}
        if not by:
            continue
        lens = sorted({p for p, _ in by})
        short, longest = lens[0], lens[-1]
        mid = min(lens, key=lambda n: abs(n - 2900))
        f = {}
        if (longest, 1) in by and (short, 1) in by:
            f[f"c1_tok_s_{longest}_over_{short}"] = round(
                by[(longest, 1)]["tok_s"] / by[(short, 1)]["tok_s"], 3
            )
            f[f"c1_ttft_ms_p50_{longest}"] = by[(longest, 1)]["ttft_ms_p50"]
        if (mid, 16) in by and (short, 16) in by:
            f[f"c16_tok_s_{mid}_over_{short}"] = round(
                by[(mid, 16)]["tok_s"] / by[(short, 16)]["tok_s"], 3
            )
        if part in res["admission"]:
            a = res["admission"][part]
            f["admission_p99_over_itl_p50"] = a["admission_p99_over_all_p50"]
            f["admission_long_ttft_ms"] = a["long_ttft_ms"]
        out[part] = f
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for part, style in (("before", "--o"), ("after", "-s")):
        for c, ax in ((1, axes[0]), (16, axes[1])):
            rs = sorted(
                (r for r in res["rows"] if r["part"] == part and r["concurrency"] == c),
                key=lambda r: r["prompt"],
            )
            ax.plot([r["prompt"] for r in rs], [r["tok_s"] for r in rs], style, label=part)
            ax.set_title(f"output tok/s, C={c}")
            ax.set_xlabel("prompt tokens (synthetic)")
            ax.legend()
        rs = sorted(
            (r for r in res["rows"] if r["part"] == part and r["concurrency"] == 1),
            key=lambda r: r["prompt"],
        )
        axes[2].plot([r["prompt"] for r in rs], [r["ttft_ms_p50"] for r in rs], style, label=part)
    axes[2].set_title("TTFT p50 (ms), C=1")
    axes[2].set_xlabel("prompt tokens (synthetic)")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    out = Path(sys.argv[1])
    res = load(out)
    res["figures"] = ratios(res)
    (out / "long_context.json").write_text(json.dumps(res, indent=1))
    plot(res, out / "long_context.png")
    print("| part | prompt | C | tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(
        res["rows"], key=lambda r: (r["prompt"], r["concurrency"], r["part"] != "before")
    ):
        print(
            f"| {r['part']} | {r['prompt']} | {r['concurrency']} | {r['tok_s']:.0f} | "
            f"{r['ttft_ms_p50']:.1f} | {r['ttft_ms_p99']:.1f} | {r['itl_ms_p50']:.2f} | "
            f"{r['itl_ms_p99']:.2f} |"
        )
    print(json.dumps(res["figures"], indent=1))


if __name__ == "__main__":
    main()
