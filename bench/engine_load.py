"""Engine throughput without HTTP: closed-loop load on an in-process EngineRunner.

    python -m ddserve.bench.engine_load [--model smollm2-135m] [--device cuda] [--graphs auto]
        [--configs ar,dflash-b3k1] [--concurrency 1,4,16,64] [--requests 64]
        [--waves 2] [--max-tokens 128] [--temperature 0] [--prompt-set chat] [--name engine_load]
        [--compile auto|on|off] [--spec-max-batch N] [--first-token-share X] [--profile]

A config name may end in modes after `@`: `@adaptive` (dflash-b16k4@adaptive) is the same
engine with --speculative-adaptive (its budget is the ceiling); its row records the budgets
its rounds used per level and the policy's estimates (tok/s per request per budget and batch
bucket). `@hosttree` builds DFlash trees on the host (the engine before the GPU tree build:
top-k copied back, heap in Python) to compare with the default; `@nofused` runs torch's
decoder layers instead of the fused triton kernels (ddserve.engine.layer_triton); `@stepsN`
runs N decoding steps or DDTree rounds a host round trip (--num-scheduler-steps N; modes
combine: dflash-b15k4@adaptive@steps4). `--dflash-path DIR` drafts
with another trained DFlash drafter. On CUDA, DFlash rows also give the GPU time of a
drafting round's draft + tree (CUDA events around the draft call) and the wall time per round.

The worker the server runs (admission by free KV slots, prefill, one verify per round for
every active request) driven by C asyncio clients, fixed output length (ignore_eos), the
first C requests of a level not counted. Per level: output tok/s, requests/s, TTFT and
inter-round latency p50/p99, tau, and for the static engine the host time per round; where
the wall time went (the engine's `step_batch` calls, the adaptive policy's, the rest: the
runner's own work and idle time) and the CUDA graphs captured during the level (first-use
shapes the warm-up missed), and per budget its rounds' ms a round and tokens a request a
round (`by_budget`: beside the adaptive policy's estimates). `--profile` runs the engine's
worker under cProfile and keeps each config's top functions.
`ddserve bench` measures the same through the HTTP server; this isolates the engine.
Prints a table, writes NAME.json.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

from ddserve.bench.engine_cpu import (
    REGISTRY,
    load_on,
    machine_name,
    prompt_set,
    steps_mode,
    steps_of,
)
from ddserve.bench.load import RequestResult, closed_loop
from ddserve.bench.prompts import chat_ids
from ddserve.config.engine import EngineConfig
from ddserve.engine.runner import EngineRunner
from ddserve.engine.sampling import SamplingParams
from ddserve.engine.weights import load_tokenizer


async def one(runner: EngineRunner, prompt: list[int], sampling: SamplingParams):
    t0 = time.perf_counter()
    first = last = None
    gaps, tokens, stats = [], 0, None
    try:
        async for out in runner.generate(prompt, sampling):
            now = time.perf_counter()
            if out.token_ids:
                if first is None:
                    first = now
                else:
                    gaps.append((now - last) / len(out.token_ids))
                last = now
                tokens += len(out.token_ids)
            stats = out.stats
    except Exception as exc:  # noqa: BLE001 - counted as an error of the level
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}"[:200])
    return RequestResult(True, first - t0, time.perf_counter() - t0, tokens, gaps, stats.tau)


MODES = ("adaptive", "hosttree", "nofused")


def draft_timer(engine) -> list | None:
    """CUDA events around every DFlash draft call (context write, block forward, tree build):
    [(start, end, rows)], read after a sync; None off CUDA or without DFlash."""
    sd = getattr(engine, "sdraft", None)
    if sd is None or not torch.cuda.is_available():
        return None
    events, forward = [], sd.forward

    def timed(packed, key):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = forward(packed, key)
        end.record()
        events.append((start, end))
        return out

    sd.forward = timed
    return events


def step_timer(runner: EngineRunner) -> dict:
    """The wall time of the engine's `step_batch` calls and of the adaptive policy's calls,
    summed: the rest of a level's wall time is the runner's own (prompt chunks, scheduling,
    delivery) or idle. Per budget (`by_budget`: calls, rounds, seconds, requests, tokens):
    what the rounds of each budget cost and made, to set beside the adaptive policy's
    estimates."""
    acc = {"step_s": 0.0, "steps": 0, "policy_s": 0.0, "by_budget": {}}
    engine, step = runner.engine, runner.engine.step_batch

    def timed(seqs, params, *args, **kw):
        t0 = time.perf_counter()
        try:
            out = step(seqs, params, *args, **kw)
        finally:
            dt = time.perf_counter() - t0
            acc["step_s"] += dt
            acc["steps"] += 1
        # a call that raised ran no round of its own: only those that returned count here
        made = sum(len(o) for o in out if isinstance(o, list))
        b = acc["by_budget"].setdefault(params.budget, [0, 0, 0.0, 0, 0])
        rounds = getattr(engine, "round_steps", 1)
        b[0], b[1], b[2] = b[0] + 1, b[1] + rounds, b[2] + dt
        b[3], b[4] = b[3] + len(seqs) * rounds, b[4] + made
        return out

    engine.step_batch = timed
    if runner.policy is not None:
        for verb in ("choose", "record"):
            fn = getattr(runner.policy, verb)

            def timed_policy(*args, fn=fn):
                t0 = time.perf_counter()
                try:
                    return fn(*args)
                finally:
                    acc["policy_s"] += time.perf_counter() - t0

            setattr(runner.policy, verb, timed_policy)
    return acc


def captures(engine) -> int:
    """CUDA graphs captured so far by the engine's graph caches (the target's, the drafter's,
    the rounds' glue)."""
    spec = getattr(engine, "spec_graphs", None)
    return getattr(engine, "graph_count", 0) + (len(spec.graphs) if spec is not None else 0)


def profiled(runner: EngineRunner, sink: list):
    """Run the runner's worker loop under cProfile (`--profile`): `sink` gets the profile once
    the loop ends (at shutdown). The profiler slows the host; compare configs under it. From
    Python 3.12 cProfile sees every thread: the load client's functions come in too."""
    loop = runner._loop

    def run():
        prof = cProfile.Profile()
        prof.enable()
        try:
            loop()
        finally:
            prof.disable()
            sink.append(prof)

    runner._loop = run


def top_functions(prof: cProfile.Profile, n: int = 25) -> list[dict]:
    st = pstats.Stats(prof, stream=io.StringIO())
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:n]  # by time of their own
    return [
        {
            "function": f"{Path(f).name}:{line}:{fn}",
            "own_s": round(tt, 4),
            "cum_s": round(ct, 4),
            "calls": nc,
        }
        for (f, line, fn), (_, nc, tt, ct, _) in rows
    ]


def run_config(lm, name, a, prompts, levels) -> dict:
    base, *modes = name.split("@")
    kind, budget, topk = REGISTRY[base]
    cfg = EngineConfig(
        speculative_adaptive="adaptive" in modes,
        num_scheduler_steps=steps_of(modes),
        model=a.model,
        device=a.device,
        max_batch=max(levels),
        graphs=a.graphs,
        compile=a.compile,
        fused_layers="off" if "nofused" in modes else "auto",
        spec_max_batch=a.spec_max_batch,
        first_token_share=a.first_token_share,
        drafter={"kind": kind, "dflash_path": a.dflash_path if kind == "dflash" else None},
        params={"budget": budget, "topk": topk, "temperature": a.temperature},
    )
    runner = EngineRunner(cfg, loaded=lm)
    profiles: list = []
    if a.profile:
        profiled(runner, profiles)
    t0 = time.perf_counter()
    runner.start()
    if "hosttree" in modes:
        runner.engine.device_tree = False
    row = {
        "config": name,
        "engine": type(runner.engine).__name__,
        "device_tree": getattr(runner.engine, "device_tree", False),
        "fused_layers": getattr(runner.engine, "fused_layers", False),
        "dflash_path": cfg.drafter.dflash_path,
        "ready_s": round(time.perf_counter() - t0, 2),
        "levels": [],
    }
    events = draft_timer(runner.engine)
    spent = step_timer(runner)
    budgets: dict[int, int] = {}
    if runner.policy is not None:  # count the budgets the rounds use
        choose = runner.policy.choose

        def counted(batch, ceiling):
            b = choose(batch, ceiling)
            budgets[b] = budgets.get(b, 0) + 1
            return b

        runner.policy.choose = counted
    for c in levels:
        spent["by_budget"].clear()
        timing0 = dict(getattr(runner.engine, "timing", {}))
        budgets.clear()
        spent0, graphs0 = dict(spent), captures(runner.engine)

        async def send(i, c=c):
            s = SamplingParams(
                max_tokens=a.max_tokens, ignore_eos=True, temperature=a.temperature, seed=i
            )
            return await one(runner, prompts[i % len(prompts)], s)

        if events is not None:
            events.clear()
        w0 = time.perf_counter()
        lv = asyncio.run(closed_loop(send, c, max(a.requests, a.waves * c), c))
        wall = time.perf_counter() - w0
        lv.pop("tau_per_request")
        tm = getattr(runner.engine, "timing", None)
        if tm:
            rounds = max(1, tm["rounds"] - timing0["rounds"])
            for k in ("draft_s", "tree_s", "verify_s", "accept_s"):
                lv[k.replace("_s", "_ms_per_round")] = round((tm[k] - timing0[k]) / rounds * 1e3, 3)
            lv["wall_ms_per_round"] = round(wall / rounds * 1e3, 3)  # warm-up requests included
            if "trips" in tm:  # rounds a host round trip (num_scheduler_steps: at most that)
                trips = max(1, tm["trips"] - timing0["trips"])
                lv["rounds_per_trip"] = round(rounds / trips, 2)
        # where the level's wall time went: the engine's steps, the policy, the rest
        steps = max(1, spent["steps"] - spent0["steps"])
        lv["step_batch_calls"] = steps
        lv["step_batch_ms_per_call"] = round((spent["step_s"] - spent0["step_s"]) / steps * 1e3, 3)
        lv["outside_step_batch_s"] = round(wall - (spent["step_s"] - spent0["step_s"]), 3)
        lv["policy_ms_per_call"] = round((spent["policy_s"] - spent0["policy_s"]) / steps * 1e3, 4)
        lv["graphs_captured"] = captures(runner.engine) - graphs0
        # each budget's rounds: ms a round, and tokens a request a round (the policy's gain)
        lv["by_budget"] = {
            b: {
                "rounds": r,
                "ms_per_round": round(sec / r * 1e3, 3),
                "tokens_per_request_round": round(made / max(1, reqs), 3),
                "requests_per_round": round(reqs / r, 1),
            }
            for b, (_, r, sec, reqs, made) in sorted(spent["by_budget"].items())
        }
        if events:
            torch.cuda.synchronize()
            gpu = [s.elapsed_time(e) for s, e in events]
            lv["draft_rounds"] = len(gpu)
            lv["draft_gpu_ms_per_draft_round"] = round(sum(gpu) / len(gpu), 4)
        if runner.policy is not None:
            lv["round_budgets"] = dict(sorted(budgets.items()))
        row["levels"].append(lv)
        print(
            f"  {name:14s} C={c:<3d} {lv['output_tok_s']:9.1f} tok/s  tau {lv['tau_mean']}  "
            f"TTFT p50 {lv['ttft_ms_p50']} ms  ITL p50 {lv['itl_ms_p50']} ms  errors {lv['errors']}",
            flush=True,
        )
    if runner.policy is not None:
        row["policy_tok_s_per_request"] = runner.policy.snapshot()
    runner.shutdown()
    if profiles:  # the worker's loop: every level (its load and warm-up are not in it)
        row["profile_top"] = top_functions(profiles[0])
    runner.engine = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--graphs", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--spec-max-batch", type=int, default=None, help="engine.spec_max_batch")
    ap.add_argument("--first-token-share", type=float, default=0.0, help="engine.first_token_share")
    ap.add_argument("--dflash-path", default=None, help="a trained DFlash drafter directory")
    ap.add_argument("--configs", default="ar,dflash-b3k1")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument(
        "--requests", type=int, default=32, help="requests per level (the first C not counted)"
    )
    ap.add_argument(
        "--waves",
        type=int,
        default=2,
        help="at least this many times C requests per level: a level of a few waves is mostly "
        "its first prefill and its slowest request (DDTree's vary with acceptance)",
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="run the engine's worker under cProfile: each config's top functions in the JSON",
    )
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompt-set", default="chat")
    ap.add_argument("--name", default="engine_load")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    configs = a.configs.split(",")
    bad = [
        c
        for c in configs
        if (b := c.split("@"))[0] not in REGISTRY
        or REGISTRY[b[0]][0] == "dflash-fullvocab"
        or not all(m in MODES or steps_mode(m) for m in b[1:])
    ]
    if bad:
        sys.exit(f"unknown config {bad[0]!r}; known: {', '.join(REGISTRY)}")
    try:
        levels = [int(x) for x in a.concurrency.split(",")]
    except ValueError:
        sys.exit(f"--concurrency {a.concurrency!r}: expected integers like 1,4,16")
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        # no torch work in this thread: each runner loads its model in its worker. Once a
        # thread has run torch's OpenMP regions, another thread's run 2x slower on this 2-core
        # VM (libgomp throttles its spin-waits when its thread teams outnumber the cores: a
        # tiny model's token took 4.9 ms in the runner's worker after a load here, 1.9 ms
        # with the load there too); the server's engine loads in its worker the same way
        lm, machine = None, machine_name(device)
        prompts = chat_ids(load_tokenizer(a.model), prompt_set(a.prompt_set))
        dtype = str(torch.float32)
    else:
        lm, prompts, machine = load_on(a.model, device, a.prompt_set)
        dtype = str(lm.model.dtype)
    result = {
        "model": a.model,
        "machine": machine,
        "dtype": dtype,
        "max_tokens": a.max_tokens,
        "temperature": a.temperature,
        "prompt_set": a.prompt_set,
        "command": "python -m ddserve.bench.engine_load " + " ".join(sys.argv[1:]),
        "configs": [],
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in configs:
        result["configs"].append(run_config(lm, name, a, prompts, levels))
        (out / f"{a.name}.json").write_text(json.dumps(result, indent=1))
    print(
        f"\n{'config':14s} {'C':>4s} {'tok/s':>9s} {'req/s':>7s} {'tau':>6s} {'TTFT p50':>9s} {'ITL p50':>8s} {'ITL p99':>8s} {'host ms/round':>14s} {'errors':>7s} {'rounds/trip':>11s}"
    )
    for row in result["configs"]:
        for lv in row["levels"]:
            host = lv.get("accept_ms_per_round")
            print(
                f"{row['config']:14s} {lv['concurrency']:4d} {lv['output_tok_s']:9.1f} {lv['requests_per_s']:7.2f} "
                f"{lv['tau_mean'] or 0:6.2f} {lv['ttft_ms_p50'] or 0:9.2f} {lv['itl_ms_p50'] or 0:8.3f} "
                f"{lv['itl_ms_p99'] or 0:8.3f} {host if host is not None else '-':>14} "
                f"{lv['errors']:7d} {lv.get('rounds_per_trip', '-'):>11}"
            )


if __name__ == "__main__":
    main()
