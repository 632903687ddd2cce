"""Where a round's time goes at a given batch: the static engine's `step_batch` alone (no
runner, no load generator), N requests decoding in lockstep.

    python -m ddserve.bench.round_profile [--device cuda] [--configs ar,dflash-b0,dflash-b7k4@steps4]
        [--batches 16,64] [--rounds 50] [--turnover 0] [--prompt-set heldout:16] [--name round_profile]

Per config and batch: the wall time of a round and the engine's own split of it (draft,
tree on the host, verify = its launch + the one sync, accept = packing + the accept walk +
commit), then the same rounds under cProfile: the functions with the most time of their
own (`{method 'cpu' ...}` is the host waiting for the GPU; what the host does meanwhile is
the rest). As served: CUDA graphs, the fused layers, GPU trees on a GPU. A config may end in
`@stepsN` (--num-scheduler-steps N: several rounds a call); times are per engine round.
Writes NAME.json.

With `--kernels N` (a GPU), N more rounds under torch.profiler: the GPU's own time per round
(kernels and copies, inside CUDA graphs too) by the phase that launched it (`draft`: the
drafter's forward and its trees, `verify`: the target's forward, `other`: the rest of the
round: the argmax copy out, the KV moves), the GPU's busy time (their union) against the
round's wall time, and each phase's costliest kernels: what the host adds to a round is
the unprofiled wall - busy (`host_exposed_ms`; the profiler slows the host). Per-phase ms
add up work of other streams too; `launches` counts GPU operations (a graph's kernels each).
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
from collections import defaultdict
from pathlib import Path

import torch

from ddserve.bench.engine_cpu import REGISTRY, load_on, make_drafter, steps_of
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


# record_function ranges "ddserve:<phase>", the first that holds a launch names its phase
# (a newcomer's prefill runs the target's forward inside "prefill"); else "other"
PHASES = ("prefill", "draft", "verify")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def kernel_split(events: list[dict], rounds: int, wall_ms: float, top: int = 12) -> dict:
    """A chrome trace's GPU events (kernels, copies, sets; `events` = its "traceEvents")
    per round, by the phase whose host range ("ddserve:draft", "ddserve:verify") launched
    them (linked by their correlation id to the runtime call; anything else is "other"):
    ms and launches per round, the costliest `top` kernels of each phase, and the GPU's busy
    time (the union of the events' intervals) against `wall_ms` per round."""
    ranges = {ph: [] for ph in PHASES}
    launches = {}  # correlation id -> the launching runtime call's host time
    gpu = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        if cat == "user_annotation" and name.startswith("ddserve:"):
            ph = name.removeprefix("ddserve:")
            if ph in ranges:
                ranges[ph].append((e["ts"], e["ts"] + e["dur"]))
        elif cat == "cuda_runtime" or cat == "cuda_driver":
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launches[corr] = e["ts"]
        elif cat in GPU_CATS:
            gpu.append(e)

    def phase_of(ts: float | None) -> str:
        if ts is not None:
            for ph, spans in ranges.items():
                if any(a <= ts <= b for a, b in spans):
                    return ph
        return "other"

    per = defaultdict(lambda: {"us": 0.0, "n": 0, "kernels": defaultdict(lambda: [0.0, 0])})
    intervals = []
    for e in gpu:
        ph = phase_of(launches.get(e.get("args", {}).get("correlation")))
        row = per[ph]
        row["us"] += e["dur"]
        row["n"] += 1
        k = row["kernels"][e["name"][:90]]
        k[0] += e["dur"]
        k[1] += 1
        intervals.append((e["ts"], e["ts"] + e["dur"]))
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):  # the union's length
        if b > end:
            busy += b - max(a, end)
            end = b
    out = {
        "rounds": rounds,
        "wall_ms": round(wall_ms, 4),
        "gpu_busy_ms": round(busy / 1e3 / rounds, 4),
        "gpu_idle_ms": round(wall_ms - busy / 1e3 / rounds, 4),
        "phases": {},
    }
    for ph in (*PHASES, "other"):
        if ph not in per:
            continue
        row = per[ph]
        ks = sorted(row["kernels"].items(), key=lambda kv: -kv[1][0])[:top]
        out["phases"][ph] = {
            "gpu_ms": round(row["us"] / 1e3 / rounds, 4),
            "launches": round(row["n"] / rounds, 2),
            "top": [
                {"kernel": n, "us": round(us / rounds, 2), "count": round(c / rounds, 2)}
                for n, (us, c) in ks
            ],
        }
    return out


def traced(eng: StaticEngine, run, rounds: int) -> dict:
    """`run(rounds)` under torch.profiler (CPU + CUDA), the drafter's and the target's
    forwards in their named ranges; the trace's split (the trace itself is not kept)."""
    import tempfile

    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    def ranged(obj, attr: str, phase: str) -> None:
        fn = getattr(obj, attr)

        def wrapper(*args, **kwargs):
            with record_function(f"ddserve:{phase}"):
                return fn(*args, **kwargs)

        setattr(obj, attr, wrapper)

    wrapped = [(eng, "prefill_batch", "prefill"), (eng.target, "forward", "verify")]
    wrapped.append((eng.target, "replay", "verify"))  # rounds after a trip's first (static_spec)
    if eng.sdraft is not None:
        wrapped += [(eng.sdraft, a, "draft") for a in ("forward", "write_only", "again")]
    for obj, attr, phase in wrapped:
        ranged(obj, attr, phase)
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    n0 = eng.timing["rounds"]
    try:
        with torch_profile(activities=acts) as prof:
            t0 = time.perf_counter()
            run(rounds)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    finally:
        for obj, attr, _ in wrapped:
            obj.__dict__.pop(attr, None)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    rounds = eng.timing["rounds"] - n0  # the engine's rounds (several a call: @stepsN)
    return kernel_split(events, rounds, 1e3 * wall / rounds)


def profile(
    lm,
    name: str,
    batch: int,
    rounds: int,
    prompts: list[list[int]],
    turnover: int,
    kernels: int = 0,
) -> dict:
    m = lm.model
    base, *modes = name.split("@")  # @stepsN: --num-scheduler-steps N
    kind, budget, topk = REGISTRY[base]
    steps = steps_of(modes)
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
        scheduler_steps=steps,
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
    tokens0 = sum(len(s.output) for s in seqs)
    t0 = time.perf_counter()
    run(rounds)
    sync()
    wall = time.perf_counter() - t0
    calls, rounds = rounds, eng.timing["rounds"] - before["rounds"]  # several a call: @stepsN
    produced = sum(len(s.output) for s in seqs) - tokens0
    split = timing_delta(before, eng.timing, rounds)
    split["prefill_ms"] = round(1e3 * prefill[0] / rounds, 4)
    prof = cProfile.Profile()
    prof.enable()
    t1 = time.perf_counter()
    n1 = eng.timing["rounds"]
    run(calls)
    sync()
    wall_prof = time.perf_counter() - t1
    prof.disable()
    row = {
        "config": name,
        "batch": batch,
        "rounds": rounds,
        "calls": calls,
        "tokens_per_round": round(produced / rounds, 4),
        "device_tree": eng.device_tree,
        "wall_ms_per_round": round(1e3 * wall / rounds, 4),
        **split,
        "turnover": turnover,
        # the requests' tokens at the end: two versions of the engine that decode alike
        # (greedy, same rounds) give the same digest
        "outputs_sha256": hashlib.sha256(json.dumps([s.output for s in seqs]).encode()).hexdigest(),
        "profiled_wall_ms_per_round": round(1e3 * wall_prof / (eng.timing["rounds"] - n1), 4),
        "top": top_functions(prof, eng.timing["rounds"] - n1),
    }
    if kernels and gpu:
        row["kernels"] = k = traced(eng, run, kernels)
        # the profiler slows the host: what the host adds to a round unprofiled
        k["host_exposed_ms"] = round(row["wall_ms_per_round"] - k["gpu_busy_ms"], 4)
    for s in seqs:
        eng.release(s)
    if gpu:
        torch.cuda.empty_cache()
    return row


def random_smollm2(device: str):
    """SmolLM2's shapes with random weights on `device` (the GPU's split of a round without
    the GGUF; a drafter's trees find nothing to accept: its kernels' times, not its tau), 16
    random 120-token prompts. Returns load_on's (loaded model, prompt ids, machine)."""
    from types import SimpleNamespace

    from ddserve.bench.engine_cpu import machine_name
    from ddserve.bench.static_step import SMOLLM2
    from ddserve.engine.weights import random_llama

    device = device if device != "auto" else "cuda"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lm = SimpleNamespace(model=random_llama(SMOLLM2).to(device, dtype))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (120,), generator=gen).tolist() for _ in range(16)]
    return lm, prompts, machine_name(device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m", help="or random-smollm2 (no GGUF)")
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
    ap.add_argument(
        "--kernels",
        type=int,
        default=0,
        help="then this many rounds under torch.profiler (a GPU): the GPU time per round by "
        "phase (draft, verify, other), its busy time against the wall, the costliest kernels",
    )
    ap.add_argument("--name", default="round_profile")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    configs = a.configs.split(",")
    bases = [c.split("@")[0] for c in configs]
    bad = [c for c in bases if c not in REGISTRY or REGISTRY[c][0] == "dflash-fullvocab"]
    if bad:
        sys.exit(f"unknown config {bad[0]!r}; known: {', '.join(REGISTRY)}")
    try:
        batches = [int(x) for x in a.batches.split(",")]
    except ValueError:
        sys.exit(f"--batches {a.batches!r}: expected integers like 16,64")
    if a.rounds < 1 or min(batches) < 1:
        sys.exit("--rounds and --batches must be at least 1")
    if a.model == "random-smollm2":
        lm, prompts, machine = random_smollm2(a.device)
    else:
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
            row = profile(lm, name, batch, a.rounds, prompts, a.turnover, a.kernels)
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
        if "kernels" in r:
            k = r["kernels"]
            print(
                f"    GPU: busy {k['gpu_busy_ms']:.3f} ms a round; unprofiled wall - busy "
                f"{k['host_exposed_ms']:.3f} (profiled: wall {k['wall_ms']:.3f}, idle "
                f"{k['gpu_idle_ms']:.3f})"
            )
            for ph, p in k["phases"].items():
                print(f"    {ph:6s} {p['gpu_ms']:7.3f} ms {p['launches']:6.1f} launches")
                for t in p["top"][:6]:
                    print(f"        {t['us']:8.2f} us {t['count']:5.1f}x  {t['kernel'][:70]}")


if __name__ == "__main__":
    main()
