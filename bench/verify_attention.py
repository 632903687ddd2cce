"""A verify's tree attention on the GPU (issue 17: at one request of 8-32 tree rows the
attention kernel was a third of a verify step): B requests of W tree rows (a random tree
each) after P committed keys, SmolLM2's heads (9 query, 3 kv, 64 dims), bf16, the engine's
pool layout, one launch per layer for 30 layers in one CUDA graph, as a step runs them (PDL
and the key prefetch where the fused layers turn them on for that shape).

    python -m ddserve.bench.verify_attention [--shapes 1x1,1x8,1x16,1x32,4x16,16x16]
        [--keys 256,2048] [--grid] [--mode tree|full] [--name verify_attention]
        [--out bench/results]
    python -m ddserve.bench.verify_attention --plot bench/results/NAME.json

Per shape and context, side by side in one process: `default` (attention_triton.split_plan
as it stands), `before` (the same with SPLIT_TREE_MAX_ROWS = 16, the rule until 2026-12-06)
and, with --grid, every (block_m, splits, block_n, warps) of GRID. us per layer (GPU time of
the graph / layers); every launch's output is checked against the default's (max abs
difference, `diff`). Writes NAME.json (and NAME.png where matplotlib imports).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

NH, KVH, HD = 9, 3, 64
GRID = dict(block_m=[16, 32, 64], splits=[1, 2, 4, 8], block_n=[32, 64], num_warps=[4])


def random_tree(w: int, gen: torch.Generator) -> torch.Tensor:
    """[W, W] ancestor-or-self mask of a random tree whose node t's parent is before it."""
    mask = torch.eye(w, dtype=torch.long)
    for t in range(1, w):
        parent = int(torch.randint(0, t, (1,), generator=gen))
        mask[t] |= mask[parent]
    return mask


class Case:
    def __init__(
        self, b: int, w: int, keys: int, layers: int, dev: str = "cuda", mode: str = "tree"
    ):
        from ddserve.engine import layer_launch as ll
        from ddserve.engine.attention import FULL, TREE

        dev, dt = torch.device(dev), torch.bfloat16
        gen = torch.Generator().manual_seed(b * 1000 + w)
        length = max(1024, 1 << (keys + w - 1).bit_length())
        self.b, self.w, self.keys = b, w, keys
        self.ctx = 512 if keys + w <= 512 else length  # the engine's two context classes
        shape = (b, KVH, length, HD)
        self.kc = [torch.randn(shape, device=dev, dtype=dt) for _ in range(layers)]
        self.vc = [torch.randn(shape, device=dev, dtype=dt) for _ in range(layers)]
        self.q = torch.randn(b * w, NH, HD, device=dev, dtype=dt)
        self.rows = torch.arange(b, device=dev)
        self.past = (keys - torch.arange(b) % 7).clamp(min=0).to(dev)
        self.tree = torch.stack([random_tree(w, gen) for _ in range(b)]).to(dev)
        # full: the drafter's block (every new row sees all W, its window's committed keys)
        full = mode == "full"
        self.mode = FULL if full else TREE
        self.window = torch.full((b,), 2048, device=dev) if full else None
        fused = b * w <= ll.FUSED_MAX_ROWS  # wider forwards attend outside the PDL chain
        self.pdl = fused and ll.pdl_on(dev, self.ctx, b, b * w)
        self.prefetch = fused and ll.prefetch_on(dev, self.ctx, b, b * w)

    def launch(self, kc, vc, splits=None, **tune):
        from ddserve.engine.attention import TREE
        from ddserve.engine.attention_triton import launch

        tree = self.tree if self.mode == TREE else None
        return launch(
            self.q, kc, vc, self.rows, self.past, tree, self.window, self.w, self.mode, self.ctx,
            splits, pdl=self.pdl, prefetch=self.prefetch, **tune,
        )  # fmt: skip

    def plan(self) -> list[int]:
        """The launch's (block_m, splits) by attention_triton's rule as it stands."""
        from ddserve.engine import attention_triton as T

        sms = T.multiprocessors(self.q.device)
        return list(T.split_plan(self.b, self.w, NH // KVH, KVH, self.mode, self.ctx, sms))

    def time(self, splits=None, **tune) -> tuple[float, float]:
        """(us per layer, max abs difference of layer 0's output from the default's)."""
        from ddserve.bench.layer_kernels import graph_ms

        def run():
            for kc, vc in zip(self.kc, self.vc, strict=True):
                self.launch(kc, vc, splits, **tune)

        us = graph_ms(run) / len(self.kc) * 1e3
        ref = self.launch(self.kc[0], self.vc[0])
        diff = (self.launch(self.kc[0], self.vc[0], splits, **tune) - ref).abs().max().item()
        return us, diff


@torch.inference_mode()
def measure(a) -> dict:
    from ddserve.bench.layer_kernels import save
    from ddserve.engine import attention_triton as T
    from ddserve.engine.static import next_bucket

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": "python -m ddserve.bench.verify_attention " + " ".join(sys.argv[1:]),
        "split_tree_max_rows": T.SPLIT_TREE_MAX_ROWS,
        "cases": [],
    }
    now = T.SPLIT_TREE_MAX_ROWS
    for keys in (int(k) for k in a.keys.split(",")):
        for shape in a.shapes.split(","):
            b, w = (int(x) for x in shape.split("x"))
            c = Case(b, w, keys, a.layers, mode=a.mode)
            row = {"b": b, "w": w, "keys": keys, "ctx": c.ctx, "pdl": c.pdl, "mode": a.mode}
            try:
                T.SPLIT_TREE_MAX_ROWS = 16
                row["before_plan"] = c.plan()
                row["before_us"], _ = c.time()
            finally:
                T.SPLIT_TREE_MAX_ROWS = now
            row["default_plan"] = c.plan()
            row["default_us"], _ = c.time()
            sweep = []
            if a.grid:
                rows_g = NH // KVH * w
                for bm, s, bn, nw in itertools.product(*GRID.values()):
                    if bm > next_bucket(rows_g, 16, 64):
                        continue  # a query block past the rows: the next smaller one's work
                    try:
                        us, diff = c.time(s, block_m=bm, block_n=bn, num_warps=nw)
                    except Exception as e:  # noqa: BLE001 - a set that does not compile
                        print(f"  {shape} {keys}: {bm, s, bn, nw} failed: {e}", flush=True)
                        continue
                    sweep.append({"params": [bm, s, bn, nw], "us": round(us, 2), "diff": diff})
                sweep.sort(key=lambda t: t["us"])
                row["best"] = sweep[0] if sweep else None
                row["max_diff"] = max((t["diff"] for t in sweep), default=0.0)
            row["before_us"] = round(row["before_us"], 2)
            row["default_us"] = round(row["default_us"], 2)
            row["sweep"] = sweep
            print(
                f"{b}x{w} keys {keys}: before {row['before_us']} us {row['before_plan']}, "
                f"default {row['default_us']} us {row['default_plan']}"
                + (f", best {row['best']}" if row.get("best") else ""),
                flush=True,
            )
            result["cases"].append(row)
            save(result, a)
            del c
    return result


def plot(result: dict, path: Path) -> None:
    """Bars per case: before / default / the grid's best, us per layer."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no PNG (run --plot JSON where it is)", file=sys.stderr)
        return
    cases = result["cases"]
    labels = [f"{c['b']}x{c['w']}\n{c['keys']} keys" for c in cases]
    series = {
        "before (16-row limit)": [c["before_us"] for c in cases],
        "default": [c["default_us"] for c in cases],
    }
    if all(c.get("best") for c in cases):  # a --grid run
        series["grid's best"] = [c["best"]["us"] for c in cases]
    fig, ax = plt.subplots(figsize=(max(6, len(cases) * 0.9), 4))
    width = 0.8 / len(series)
    for i, (name, ys) in enumerate(series.items()):
        ax.bar(
            [x + (i - (len(series) - 1) / 2) * width for x in range(len(cases))],
            ys,
            width,
            label=name,
        )
    ax.set_xticks(range(len(cases)), labels, fontsize=7)
    ax.set_ylabel("us per layer (30 layers in a CUDA graph)")
    mode = cases[0].get("mode", "tree") if cases else "tree"
    ax.set_title(f"{mode} attention, {result['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x1,1x8,1x16,1x32,4x16,16x16")
    ap.add_argument("--keys", default="256,2048")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--grid", action="store_true", help="also sweep GRID")
    ap.add_argument(
        "--mode",
        choices=["tree", "full"],
        default="tree",
        help="tree: a verify (random trees); full: the drafter's block (all W rows see each "
        "other, a 2,048-key window)",
    )
    ap.add_argument("--name", default="verify_attention")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--plot", help="only draw NAME.png from a result JSON")
    a = ap.parse_args()
    if a.plot:
        path = Path(a.plot)
        plot(json.loads(path.read_text()), path.with_suffix(".png"))
        return 0
    if not torch.cuda.is_available():
        sys.exit("ddserve.bench.verify_attention times GPU kernels: it needs a GPU")
    result = measure(a)
    plot(result, Path(a.out) / f"{a.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
