"""Where a round's time goes at a given batch: the static engine's `step_batch` alone (no
runner, no load generator), N requests decoding in lockstep.

    python -m ddserve.bench.round_profile [--device cuda] [--configs ar,dflash-b0,dflash-b7k4]
        [--batches 16,64] [--rounds 50] [--turnover 0] [--prompt-set heldout:16] [--name round_profile]

Per config and batch: the wall time of a round and the engine's own split of it (draft,
tree on the host, verify = its launch + the one sync, accept = packing + the accept walk +
commit), then the same rounds under cProfile: the functions with the most time of their
own (`{method 'cpu' ...}` is the host waiting for the GPU; what the host does meanwhile is
the rest). As served: CUDA graphs, the fused layers, GPU trees on a GPU. Writes NAME.json.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

from ddserve.bench.engine_cpu import REGISTRY, load_on, make_drafter
from ddserve.config.engine import LiveParams
from ddserve.engine.sampling import SamplingParams
from ddserve.engine.static_engine import StaticEngine

WARM = 5  # rounds before any is timed (first-use work: graphs of new shapes, context classes)


def timing_delta(before: dict, after: dict, rounds: int) -> dict:
    """The engine's time split per round, in ms."""
    return {
        k.removesuffix("_s") + "_ms": round(1e3 * (after[k] - before.get(k, 0.0)) / rounds, 4)
        for k in after
        if k.endswith("_s")
    }


def top_functions(prof: cProfile.Profile, rounds: int, n: int = 20) -> list[dict]:
    """The `n` functions with the most time of their own, per round (ms) and calls per round."""
    st = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, fn), (_, calls, tottime, cumtime, _) in st.stats.items():
        where = fn if file == "~" else f"{Path(file).name}:{line}({fn})"
        rows.append(
            {
                "function": where,
                "own_ms": round(1e3 * tottime / rounds, 4),
                "cum_ms": round(1e3 * cumtime / rounds, 4),
                "calls": round(calls / rounds, 2),
            }
        )
    rows.sort(key=lambda r: -r["own_ms"])
    return rows[:n]


def profile(
    lm, name: str, batch: int, rounds: int, prompts: list[list[int]], turnover: int
) -> dict:
    m = lm.model
    kind, budget, topk = REGISTRY[name]
    gpu = m.device.type == "cuda"
    eng = StaticEngine(
        m,
        make_drafter(kind, m, None),
        8,
        m.cfg.eos_token_ids,
        slots=batch,
        max_context=4096,
        graphs=gpu,
        compile=gpu,
    )
    params = LiveParams(budget=budget, topk=topk)
    eng.warm_up(params)
    sampling = SamplingParams(max_tokens=eng.pool.usable, ignore_eos=True)
    seqs = [eng.new_sequence(prompts[i % len(prompts)], sampling) for i in range(batch)]
    eng.prefill_batch(seqs)

    prefill = [0.0]
    made = [batch]

    def run(n: int) -> None:
        for r in range(n):
            if turnover and r % turnover == 0:  # a request leaves, a new one joins (prefilled)
                i = made[0] % batch
                eng.release(seqs[i])
                seqs[i] = eng.new_sequence(prompts[made[0] % len(prompts)], sampling)
                made[0] += 1
                t = time.perf_counter()
                eng.prefill_batch([seqs[i]])
                prefill[0] += time.perf_counter() - t
            for out in eng.step_batch(seqs, params):
                if isinstance(out, Exception):
                    raise out

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    run(WARM)
    sync()
    before, prefill[0] = dict(eng.timing), 0.0
    t0 = time.perf_counter()
    run(rounds)
    sync()
    wall = time.perf_counter() - t0
    split = timing_delta(before, eng.timing, rounds)
    split["prefill_ms"] = round(1e3 * prefill[0] / rounds, 4)
    prof = cProfile.Profile()
    prof.enable()
    t1 = time.perf_counter()
    run(rounds)
    sync()
    wall_prof = time.perf_counter() - t1
    prof.disable()
    row = {
        "config": name,
        "batch": batch,
        "rounds": rounds,
        "device_tree": eng.device_tree,
        "wall_ms_per_round": round(1e3 * wall / rounds, 4),
        **split,
        "turnover": turnover,
        # the requests' tokens at the end: two versions of the engine that decode alike
        # (greedy, same rounds) give the same digest
        "outputs_sha256": hashlib.sha256(json.dumps([s.output for s in seqs]).encode()).hexdigest(),
        "profiled_wall_ms_per_round": round(1e3 * wall_prof / rounds, 4),
        "top": top_functions(prof, rounds),
    }
    for s in seqs:
        eng.release(s)
    if gpu:
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--configs", default="ar,dflash-b0,dflash-b7k4")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--prompt-set", default="heldout:16")
    ap.add_argument(
        "--turnover",
        type=int,
        default=0,
        help="every this many rounds a request leaves and a new one joins, its prompt prefilled "
        "before the round (timed apart: prefill_ms; its drafter context is written in the "
        "round's draft, as served); 0: the same requests throughout",
    )
    ap.add_argument("--name", default="round_profile")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    configs = a.configs.split(",")
    bad = [c for c in configs if c not in REGISTRY or REGISTRY[c][0] == "dflash-fullvocab"]
    if bad:
        sys.exit(f"unknown config {bad[0]!r}; known: {', '.join(REGISTRY)}")
    try:
        batches = [int(x) for x in a.batches.split(",")]
    except ValueError:
        sys.exit(f"--batches {a.batches!r}: expected integers like 16,64")
    if a.rounds < 1 or min(batches) < 1:
        sys.exit("--rounds and --batches must be at least 1")
    lm, prompts, machine = load_on(a.model, a.device, a.prompt_set)
    result = {
        "model": a.model,
        "machine": machine,
        "dtype": str(lm.model.dtype),
        "command": "python -m ddserve.bench.round_profile " + " ".join(sys.argv[1:]),
        "rows": [],
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in configs:
        for batch in batches:
            row = profile(lm, name, batch, a.rounds, prompts, a.turnover)
            result["rows"].append(row)
            (out / f"{a.name}.json").write_text(json.dumps(result, indent=1))
    print(
        f"{'config':14s} {'B':>3s} {'wall':>7s} {'draft':>7s} {'tree':>6s} {'verify':>7s} "
        f"{'accept':>7s} {'prefill':>7s}  (ms per round)  outputs"
    )
    for r in result["rows"]:
        print(
            f"{r['config']:14s} {r['batch']:3d} {r['wall_ms_per_round']:7.3f} "
            f"{r.get('draft_ms', 0):7.3f} {r.get('tree_ms', 0):6.3f} {r.get('verify_ms', 0):7.3f} "
            f"{r.get('accept_ms', 0):7.3f} {r['prefill_ms']:7.3f}  {r['outputs_sha256'][:12]}"
        )
        for t in r["top"][:8]:
            print(f"      {t['own_ms']:7.3f} own {t['calls']:7.1f}x  {t['function']}")


if __name__ == "__main__":
    main()
