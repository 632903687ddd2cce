"""Where the PDL chain and serial launches part (GPU diagnosis of
tests/engine/test_layer_triton.py::test_pdl_chain_equals_serial_launches): the test's chain
of twelve fused layers under a CUDA graph, 20 replays with new inputs, for each mode against
serial launches (PDL and prefetch off): whether it equals, the first replay and tensor that
differ and by how much; also serial against itself (run-to-run determinism).

    python -m ddserve.bench.pdl_check [--modes serial,pdl,prefetch,both] [--out FILE]

Each mode runs with the warm-up on zero inputs (as the test first did: a row's two tokens
store their keys to one position, the winner undefined) and on the first replay's inputs
(as the test now does). A mismatch is reported with the differing pool positions, so one
that starts in the pools shows there. Reading: serial against serial differing =
nondeterminism; prefetch alone (nothing overlaps) differing = code generation or the
warm-up; pdl differing while prefetch matches = ordering (a load before the wait, or a
stale line after it).
"""

from __future__ import annotations

import argparse
import json

import torch

from tests.engine.test_layer_triton import pdl_chain_replays

MODES = {
    "serial": (False, False),
    "pdl": (True, False),
    "prefetch": (False, True),
    "both": (True, True),
}


def run(mode: str, fixed_cos: bool, same_inputs: bool, real_warmup: bool) -> list:
    pdl, prefetch = MODES[mode]
    return pdl_chain_replays(
        pdl, prefetch, real_warmup=real_warmup, fixed_cos=fixed_cos, same_inputs=same_inputs
    )


def compare(a, b) -> dict:
    for r, (sa, sb) in enumerate(zip(a, b, strict=True)):
        for t, (x, y) in enumerate(zip(sa, sb, strict=True)):
            if not torch.equal(x, y):
                d = (x.float() - y.float()).abs()
                return {
                    "equal": False,
                    "replay": r,
                    "tensor": t,
                    "max_abs": d.max().item(),
                    "n_diff": int((d > 0).sum().item()),
                    "numel": d.numel(),
                }
    return {"equal": True}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="serial,pdl,prefetch,both")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    report = {}
    for real, fixed_cos, same in (
        (True, False, False),
        (False, False, False),
        (True, True, False),
        (True, True, True),
    ):
        base = run("serial", fixed_cos, same, real)
        for mode in a.modes.split(","):
            key = f"{mode} real_warmup={real} fixed_cos={fixed_cos} same_inputs={same}"
            report[key] = compare(base, run(mode, fixed_cos, same, real))
            print(key, report[key], flush=True)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
