"""Run a bench module with the fused layer kernels tuned by a bench.layer_kernels run: its
best launch parameters per row block, and the row limit raised to what its whole-layer
timings won (apply_tune), in this process, then the module as `-m`.

    python -m ddserve.bench.tuned LAYER_KERNELS_JSON[,JSON...] MODULE [ARGS...]

For a lease that measures the engine with parameters an earlier call of the same lease
found, before they are written into layer_launch.DEFAULTS. A JSON may also hold
"attention": {NAME: value} for the attention kernel's policy constants (ATTENTION_KNOBS), e.g.
{"attention": {"SPLIT_TREE_MAX_ROWS": 16}} for the key-split rule of before 2026-12-06, and
"engine": {NAME: value} for the static engine's switches (ENGINE_KNOBS), and "split_k":
{"KERNEL:ROWS": programs} for the layer kernels' split-K (layer_launch.SPLIT_K, per kernel
and row class), e.g. {"split_k": {"qkv:16": 3, "down:16": 3}}."""

from __future__ import annotations

import importlib
import json
import runpy
import sys
from pathlib import Path

from ddserve.engine import layer_launch as ll

# module constants a JSON may set, name -> its module under ddserve.engine: "attention",
# the attention kernel's policy; "engine", the static engine's switches
ATTENTION_KNOBS = dict.fromkeys(
    ("SPLIT_TREE_MAX_ROWS", "WIDE_TREE_FILL", "PREFETCH_KEYS"), "attention_triton"
)
ENGINE_KNOBS = {
    "DRAFT_FUSED_LAYERS": "static_engine",
    "COMPILE_GLUE": "static_models",
    "SPEC_GLUE_COMPILED": "static_spec",
    "CAPTURE_STREAM_WARM_UP": "graphs",
    "JOIN_BESIDE_TRIP": "rounds",
    "CATCH_UP_GRAPH_ROWS": "static_dflash",
    "BUFFERED_ROWS": "static_dflash",
    "ROUND_TIMES_TRIPS": "static_startup",
    "FULL_TRIPS_ONLY": "adaptive",
}


def _set_knobs(knobs: dict, known: dict[str, str], what: str) -> None:
    unknown = sorted(set(knobs) - set(known))
    if unknown:
        sys.exit(f"ddserve.bench.tuned: unknown {what} knobs {unknown}; known: {sorted(known)}")
    for name, value in knobs.items():
        setattr(importlib.import_module(f"ddserve.engine.{known[name]}"), name, value)


def apply_tune(paths: str) -> dict:
    """The best launch parameters of bench.layer_kernels runs (their JSONs, a comma list)
    into layer_launch.TUNE, per row class (`block_m`: runs before 2026-12-06 recorded the
    tile block there; of several row counts in one class, the fewest rows'),
    and layer_launch.FUSED_MAX_ROWS raised to the most rows at which their fused layer beat
    the compiled one with every fewer measured row count also won (row counts between two
    measured ones are taken to behave as the larger; the limit is never lowered). Returns
    what it set."""
    res, knobs, engine, splits = {}, {}, {}, {}
    for path in paths.split(","):
        data = json.loads(Path(path).read_text())
        res.update(data.get("rows", {}))
        knobs.update(data.get("attention", {}))
        engine.update(data.get("engine", {}))
        splits.update(data.get("split_k", {}))
    _set_knobs(knobs, ATTENTION_KNOBS, "attention")
    _set_knobs(engine, ENGINE_KNOBS, "engine")
    for key, n in splits.items():
        kernel, _, rows = key.partition(":")
        if kernel not in ll.KERNELS or not rows.isdigit() or ll.rows_key(int(rows)) != int(rows):
            sys.exit(
                f"ddserve.bench.tuned: split_k key {key!r} is not KERNEL:ROWS "
                f"(kernels {list(ll.KERNELS)}, rows a power of two up to 64)"
            )
        ll.SPLIT_K[(kernel, int(rows))] = int(n)
    for rows in sorted(res, key=int, reverse=True):  # the fewest rows of a block set it last
        r = res[rows]
        for k, v in r.get("best", {}).items():
            if k != "attn":  # the attention kernel keeps its own parameters
                ll.TUNE[(k, r["block_m"])] = tuple(v)
        for k, n in r.get("best_split", {}).items():  # runs with --splits
            ll.SPLIT_K[(k, r["block_m"])] = int(n)
    for rows in sorted(res, key=int):
        us = res[rows].get("layer_us", {})
        if not us or us["fused_best"] >= us["compile"]:
            break
        ll.FUSED_MAX_ROWS = max(ll.FUSED_MAX_ROWS, int(rows))
    return {
        "tune": {str(k): v for k, v in ll.TUNE.items()},
        "splits": {str(k): v for k, v in ll.SPLIT_K.items()},
        "fused_max_rows": ll.FUSED_MAX_ROWS,
        "attention": knobs,
        "engine": engine,
        "split_k": splits,
    }


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: python -m ddserve.bench.tuned LAYER_KERNELS_JSON MODULE [ARGS...]")
    path, module, *args = sys.argv[1:]
    print(f"ddserve.bench.tuned: {apply_tune(path)}", file=sys.stderr, flush=True)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
