"""The GPU tree build alone (ddserve.engine.tree_triton.build_trees), µs a call, at the
shapes a round builds: B requests, a DFlash block of D depths with the top K each, a budget.
`--against FILE`: another version of tree_triton.py (e.g. `git show REV:service/engine/
tree_triton.py > old.py`) timed beside this one in the same process, with its outputs
checked equal to this one's.

    python -m ddserve.bench.tree_build [--shapes 1x15x4,4x15x4,16x7x4,64x7x4] [--depth 8]
        [--against old.py] [--name tree_build] [--out bench/results]

Writes NAME.json: per shape (BxBUDGETxK) and version, µs a call (a CUDA graph of 20 calls,
replayed 20 times: layer_kernels.graph_ms)."""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

from ddserve.bench.layer_kernels import graph_ms, save
from ddserve.engine import tree_triton
from ddserve.engine.static import next_bucket
from ddserve.engine.tree import size_bound

CALLS = 20  # tree builds in the timed graph


def load_version(path: str):
    spec = importlib.util.spec_from_file_location("tree_triton_other", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def inputs(b: int, depth: int, k: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(b, depth, 16384, device="cuda", generator=g) * 3
    lp, ids = torch.topk(torch.log_softmax(logits, -1), k, -1)
    root = torch.randint(0, 16384, (b,), device="cuda", generator=g)
    lens = torch.randint(10, 500, (b,), device="cuda", generator=g)
    return lp.double(), ids, root, lens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x7x4,1x15x4,1x31x4,4x15x4,16x7x4,64x7x4,1x64x8")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--against", help="another tree_triton.py, timed beside this one")
    ap.add_argument("--name", default="tree_build")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ddserve.bench.tree_build times a GPU kernel: it needs a GPU")
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
        assert all(len(s) == 3 and min(s) >= 1 for s in shapes)
    except (ValueError, AssertionError):
        sys.exit(f"--shapes {a.shapes!r}: expected BxBUDGETxK[,...] like 1x15x4")
    versions = {"this": tree_triton}
    if a.against:
        versions["against"] = load_version(a.against)
    rows = []
    for b, budget, k in shapes:
        lp, ids, root, lens = inputs(b, a.depth, k)
        width = next_bucket(size_bound(budget, a.depth, k) + 1, 1, 1 << 30)
        row = {"shape": f"{b}x{budget}x{k}", "depth": a.depth, "width": width, "us": {}}
        outs = {}
        args = (lp, ids, root, lens, budget, k, width)
        for name, mod in versions.items():
            call = lambda m=mod, args=args: m.build_trees(*args)  # noqa: E731
            outs[name] = [t.clone() for t in call()]
            # CALLS calls in one CUDA graph, replayed (layer_kernels.graph_ms): us a call
            calls = lambda call=call: [call() for _ in range(CALLS)]  # noqa: E731
            row["us"][name] = round(1e3 * graph_ms(calls) / CALLS, 2)
        if len(outs) == 2:
            row["equal"] = all(torch.equal(x, y) for x, y in zip(*outs.values(), strict=True))
        rows.append(row)
        print(row, flush=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": "python -m ddserve.bench.tree_build " + " ".join(sys.argv[1:]),
        "rows": rows,
    }
    save(result, a)


if __name__ == "__main__":
    main()
