"""The fused layer kernels (ddserve.engine.layer_triton) one by one, on the GPU: each kernel's
time per launch for every launch-parameter set of a grid, at the row counts of decode and
verify, next to torch's compiled layer; the best set per (kernel, row block) is what
layer_launch.DEFAULTS should hold.

    python -m ddserve.bench.layer_kernels [--rows 1,16,32,64] [--layers 30] [--grids tc,gemv]
        [--kernels qkv,gate_up,o,down,attn] [--splits 1,2,3] [--name layer_kernels]

Every timing is a CUDA graph of one launch per layer, each layer its own weights (SmolLM2's
shapes, random, bf16), so weights stream from memory as in a real step rather than sit in
L2; replayed 20 times, per launch. Then whole layers (qkv + attention + o + gate/up + down)
with the defaults and with the best sets, against the torch.compile'd reference layer, and
the best sets once more without programmatic dependent launch (layer_launch.PDL), then
also without the L2 prefetches (PREFETCH), side by side. --splits: every layer kernel's set
also with its K loop split over that many programs a tile (layer_launch.SPLIT_K,
ddserve.engine.layer_split; a set whose input is fewer block_k steps takes fewer); the best
split per kernel is "best_split" (bench.tuned reads it). Writes NAME.json under --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from ddserve.bench.static_step import SMOLLM2
from ddserve.engine import layer_launch as ll
from ddserve.engine import layer_triton as lt
from ddserve.engine.attention import TREE, plan
from ddserve.engine.llama import Block, Rotary
from ddserve.engine.static import compile_layer_step, fuse_weights

GRID = {
    # qkv's block_n: rotary columns per half a program (0: the whole half)
    "qkv": dict(bn=[0, 16], bk=[256, 1024], warps=[4, 8], stages=[1]),
    "gate_up": dict(bn=[16, 32], bk=[128, 256, 1024], warps=[4, 8], stages=[1, 3]),
    "o": dict(bn=[16, 32], bk=[128, 256, 1024], warps=[4, 8], stages=[1, 3]),
    "down": dict(bn=[16, 32], bk=[256, 512, 2048], warps=[4, 8], stages=[1, 3]),
    # attention (ddserve.engine.attention_triton.launch): bn = key splits, bk = BLOCK_N
    "attn": dict(bn=[1, 2, 4], bk=[32, 64], warps=[4], stages=[1]),
}
# GEMV sets (block_n < 16: CUDA-core products, a program's rows the forward's): narrow column
# blocks, so a 1-row forward has ~100-400 programs where tensor-core tiles give it 15-48;
# block_k past the input width is one K step (the row's whole input in one load)
GEMV_GRID = {
    "qkv": dict(bn=[2, 4, 8], bk=[128, 1024], warps=[2, 4], stages=[1, 3]),
    "gate_up": dict(bn=[4, 8], bk=[128, 1024], warps=[2, 4], stages=[1, 3]),
    "o": dict(bn=[4, 8], bk=[128, 1024], warps=[2, 4], stages=[1, 3]),
    "down": dict(bn=[4, 8], bk=[256, 2048], warps=[2, 4], stages=[1, 3]),
}
GEMV_MAX_ELEMENTS = 16384  # rows x block_n x block_k of a program's product, in registers


def grid_sets(name: str, rows: int, grids: str):
    """The (bn, bk, warps, stages) sets to time for kernel `name` at `rows` rows: the
    tensor-core grid where `grids` has "tc" (else only the layer kernels' default sets), and
    the GEMV grid where it has "gemv" (sets whose product tile would not fit in registers left
    out, as are num_stages > 1 where one K step covers the input)."""
    sets = []
    if "tc" in grids:
        sets += list(itertools.product(*GRID[name].values()))
    elif name != "attn":
        sets.append(ll.launch_params(name, rows))  # the defaults, beside the others
    if "gemv" in grids and name in GEMV_GRID:
        k = SMOLLM2.intermediate_size if name == "down" else SMOLLM2.hidden_size
        bm = min(ll.rows_key(rows), ll.GEMV_BLOCK_ROWS)
        for bn, bk, warps, stages in itertools.product(*GEMV_GRID[name].values()):
            if bm * bn * bk <= GEMV_MAX_ELEMENTS and not (stages > 1 and bk >= k):
                sets.append((bn, bk, warps, stages))
    return sets


def graph_ms(fn, reps: int = 20) -> float:
    """Per-call GPU time of `fn` (one launch per layer inside), as a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


class Layers:
    def __init__(self, n_layers: int, rows: int, ctx: int = 256):
        cfg = SMOLLM2
        self.blocks = []
        for i in range(n_layers):
            torch.manual_seed(i)
            b = Block(cfg).to("cuda", torch.bfloat16)
            with torch.no_grad():
                for p in b.parameters():
                    p.normal_(0, 0.02)
                b.input_layernorm.weight.fill_(1.0)
                b.post_attention_layernorm.weight.fill_(1.0)
            fuse_weights(b)
            self.blocks.append(b)
        dev, dt = "cuda", torch.bfloat16
        shape = (64, cfg.num_kv_heads, 1024, cfg.head_dim)
        self.kc = [torch.randn(shape, device=dev, dtype=dt) for _ in range(n_layers)]
        self.vc = [torch.randn(shape, device=dev, dtype=dt) for _ in range(n_layers)]
        self.x = torch.randn(rows, cfg.hidden_size, device=dev, dtype=dt)
        self.att = torch.randn(rows, cfg.num_heads * cfg.head_dim, device=dev, dtype=dt)
        self.act = torch.randn(rows, cfg.intermediate_size, device=dev, dtype=dt)
        self.rows = torch.arange(rows, device=dev)  # B = rows, W = 1 (decode)
        past = torch.full((rows,), ctx, device=dev)
        self.wpos = past[:, None]
        self.cos, self.sin = Rotary(cfg.head_dim, cfg.rope_theta).to(dev)(past, dt)
        tree = torch.ones(rows, 1, 1, dtype=torch.long, device=dev)
        groups = cfg.num_heads // cfg.num_kv_heads
        self.attn = plan("triton", past, TREE, tree, 1, 512, groups, dt)
        self.q = torch.randn(rows, cfg.num_heads, cfg.head_dim, device=dev, dtype=dt)

    def kernel(self, name: str, params: tuple[int, int, int, int]):
        """One launch per layer of `name`. The layer kernels read their launch parameters
        from layer_launch.TUNE (main sets them); attention takes `params` = (key splits,
        BLOCK_N, warps, stages) directly."""

        def qkv():
            for b, kc, vc in zip(self.blocks, self.kc, self.vc, strict=True):
                lt.qkv_rope(b, self.x, self.cos, self.sin, kc, vc, self.rows, self.wpos)

        def gate_up():
            for b in self.blocks:
                lt.gate_up(b, self.x)

        def o():
            for b in self.blocks:
                lt.matmul_add(self.att, b.o_proj.weight, self.x, "o")

        def down():
            for b in self.blocks:
                lt.matmul_add(self.act, b.down_proj.weight, self.x, "down")

        def attn():
            from ddserve.engine.attention_triton import launch

            splits, bn, warps, stages = params
            for kc, vc in zip(self.kc, self.vc, strict=True):
                a = self.attn
                launch(
                    self.q, kc, vc, self.rows, a.past, a.tree, None, 1, TREE, 512, splits,
                    pdl=ll.pdl_on(self.q.device, rows=self.q.shape[0]),
                    prefetch=ll.prefetch_on(self.q.device, rows=self.q.shape[0]),
                    block_n=bn, num_warps=warps, num_stages=stages,
                )  # fmt: skip

        return {"qkv": qkv, "gate_up": gate_up, "o": o, "down": down, "attn": attn}[name]

    def layers(self, fn):
        def run():
            x = self.x
            for b, kc, vc in zip(self.blocks, self.kc, self.vc, strict=True):
                x = fn(b, x, self.cos, self.sin, kc, vc, self.rows, self.wpos, self.attn, True)

        return run


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,32,64")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--name", default="layer_kernels")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--verbose", action="store_true", help="every timing, not only the best")
    ap.add_argument(
        "--grids",
        default="tc",
        help="comma list: tc (the tensor-core grid, attention's too; without it each layer "
        "kernel's default set only), gemv (the GEMV grid)",
    )
    ap.add_argument("--kernels", default="qkv,gate_up,o,down,attn")
    ap.add_argument("--splits", default="1", help="split-K counts to time each set with")
    ap.add_argument(
        "--gemv-block-rows",
        type=int,
        help="the most rows a GEMV program takes (layer_launch.GEMV_BLOCK_ROWS; default its own)",
    )

    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ddserve.bench.layer_kernels times GPU kernels: it needs a GPU")
    if a.gemv_block_rows:
        ll.GEMV_BLOCK_ROWS = a.gemv_block_rows
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        # PDL and the prefetches for 1 row, as the engine runs (GEMV forwards of more rows: off)
        "pdl": ll.pdl_on(torch.device("cuda")),
        "gemv_block_rows": ll.GEMV_BLOCK_ROWS,
        "command": "python -m ddserve.bench.layer_kernels " + " ".join(sys.argv[1:]),
        "rows": {},
    }
    compiled = compile_layer_step()
    for rows in (int(r) for r in a.rows.split(",")):
        bm = ll.rows_key(rows)  # the row class TUNE's entries are keyed by
        L = Layers(a.layers, rows)
        res = result["rows"][rows] = {"block_m": bm, "kernels": {}}
        best, best_split = {}, {}
        for name in a.kernels.split(","):
            timings = []
            splits = [1] if name == "attn" else [int(n) for n in a.splits.split(",")]
            sets = grid_sets(name, rows, a.grids)
            for (bn, bk, warps, stages), split in itertools.product(sets, splits):
                if rows > 32 and bn >= 16 and bk > 256:  # the x tile would not fit in registers
                    continue
                params = (bn, bk, warps, stages)
                if name != "attn":  # a layer kernel: read from TUNE at launch
                    ll.TUNE[(name, bm)] = params
                    ll.SPLIT_K[(name, bm)] = split
                t0 = time.perf_counter()
                try:
                    ms = graph_ms(L.kernel(name, params)) / a.layers * 1e3
                except Exception:  # noqa: BLE001 - a set that does not compile (shared memory)
                    continue
                timings.append({"params": list(params), "split": split, "us": round(ms, 2)})
                if a.verbose:
                    print(
                        f"rows {rows:3d} {name:8s} bn {bn:3d} bk {bk:5d} warps {warps} "
                        f"stages {stages} split {split}: {ms:6.2f} us  "
                        f"({time.perf_counter() - t0:.1f} s)",
                        flush=True,
                    )
            ll.TUNE.pop((name, bm), None)
            ll.SPLIT_K.pop((name, bm), None)
            timings.sort(key=lambda t: t["us"])
            if not timings:  # no parameter set compiled at this row block
                continue
            best[name] = tuple(timings[0]["params"])
            if name != "attn":
                best_split[name] = timings[0]["split"]
            res["kernels"][name] = timings
            print(f"rows {rows} {name}: best {timings[:3]}", flush=True)
            save(result, a)
        # whole layers: compiled reference, fused with the defaults, fused with the best sets
        per_layer = {}
        per_layer["compile"] = graph_ms(L.layers(compiled)) / a.layers * 1e3
        per_layer["fused_defaults"] = graph_ms(L.layers(lt.fused_layer_step)) / a.layers * 1e3
        ll.TUNE.update({(k, bm): v for k, v in best.items() if k != "attn"})
        ll.SPLIT_K.update({(k, bm): n for k, n in best_split.items()})
        per_layer["fused_best"] = graph_ms(L.layers(lt.fused_layer_step)) / a.layers * 1e3
        try:
            ll.PDL = False  # the same kernels without programmatic dependent launch, then also
            per_layer["fused_best_nopdl"] = graph_ms(L.layers(lt.fused_layer_step)) / a.layers * 1e3
            ll.PREFETCH = False  # without the L2 prefetches
            per_layer["fused_best_plain"] = graph_ms(L.layers(lt.fused_layer_step)) / a.layers * 1e3
        finally:
            ll.PDL = ll.PREFETCH = None
        ll.TUNE.clear()
        ll.SPLIT_K.clear()
        res["best"] = {k: list(v) for k, v in best.items()}
        res["best_split"] = best_split
        res["layer_us"] = {k: round(v, 2) for k, v in per_layer.items()}
        print(f"rows {rows}: best {best}; per layer (us) {res['layer_us']}", flush=True)
        save(result, a)
    return 0


def save(result: dict, a) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
