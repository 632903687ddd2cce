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

from ddserve.engine import attention as A
from ddserve.engine import layer_triton
from ddserve.engine.layer_triton import fused_layer_step
from ddserve.engine.llama import Rotary
from tests.engine.test_layer_triton import random_block

DEV = "cuda"
MODES = {
    "serial": (False, False),
    "pdl": (True, False),
    "prefetch": (False, True),
    "both": (True, True),
}


def run(
    mode: str, fixed_cos: bool, same_inputs: bool, real_warmup: bool
) -> list[list[torch.Tensor]]:
    dt = torch.bfloat16
    layers = [random_block(False, dt, seed=i, head_dim=64) for i in range(12)]
    c = layers[0].cfg
    b, w, length = 4, 2, 256
    gen = torch.Generator().manual_seed(1)
    rotary = Rotary(c.head_dim, 10000.0).to(DEV)
    rows = torch.arange(b, device=DEV)
    past = torch.zeros(b, dtype=torch.long, device=DEV)
    wpos = torch.zeros(b, w, dtype=torch.long, device=DEV)
    x_in = torch.zeros(b * w, c.hidden_size, device=DEV, dtype=dt)
    tree = torch.ones(b, w, w, dtype=torch.long, device=DEV).tril()
    attn = A.plan("triton", past, A.TREE, tree, w, length, c.num_heads // c.num_kv_heads, dt)
    shape = (b, c.num_kv_heads, length, c.head_dim)
    pools0 = [torch.randn(shape, generator=gen).to(DEV, dt) for _ in range(2 * len(layers))]
    steps = []
    for _ in range(20):
        p = torch.randint(8, length - w - 1, (b,), generator=gen)
        x = torch.randn(b * w, c.hidden_size, generator=gen).to(dt)
        if same_inputs and steps:
            p, x = steps[0][3], steps[0][4]
        steps.append((p.to(DEV), (p[:, None] + torch.arange(w)).to(DEV), x.to(DEV), p, x))
    cs = rotary(steps[0][1].reshape(-1), dt)

    def chain(pools):
        cos, sin = cs if fixed_cos else rotary(wpos.reshape(-1), dt)
        x = x_in
        for i, block in enumerate(layers):
            x = fused_layer_step(
                block, x, cos, sin, pools[2 * i], pools[2 * i + 1], rows, wpos, attn, True
            )
        return x

    layer_triton.PDL, layer_triton.PREFETCH = MODES[mode]
    try:
        pools = [p.clone() for p in pools0]
        if real_warmup:
            past.copy_(steps[0][0])
            wpos.copy_(steps[0][1])
            x_in.copy_(steps[0][2])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            chain(pools)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(pools)
        seen = []
        for p, wp, x, _, _ in steps:
            past.copy_(p)
            wpos.copy_(wp)
            x_in.copy_(x)
            graph.replay()
            seen.append([out.clone(), *(t.clone() for t in pools)])
        torch.cuda.synchronize()
        return seen
    finally:
        layer_triton.PDL = layer_triton.PREFETCH = None


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
