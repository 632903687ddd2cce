"""One verify step of the static engine's target forward, by batch and tree width: CUDA graph
replay time, host time around it, kernels per step, and the floors.

    python -m ddserve.bench.static_step [--model smollm2-135m|random-smollm2] [--batches 1,4,16,64]
        [--widths 1,2,4,8,16] [--context 256[,7200,...]] [--modes eager,graph,compile,fused]
        [--attention sdpa,triton] [--prefill 1000,7200] [--name static_step]

For each mode (eager: no graph; graph: CUDA graph of the eager kernels; compile: CUDA graph
of the torch.compile'd layers; fused: CUDA graph of the fused triton layers of
ddserve.engine.layer_triton, compiled layers above its row limit; fused-nopdl: the same
without programmatic dependent launch; fused-plain: without it and the L2 prefetches;
fused-overlap: with both, whatever the engine's default, layer_launch.OVERLAP_AUTO; a mode
named MODE+tuned runs MODE with --fused-tune's launch parameters, the others then without
them, side by side) and
(B, W): the GPU time of one step (CUDA events over 50
replays), the full call as the engine makes it (pack inputs, copy, replay, read argmax back),
the kernels one step launches (profiler, eager/compiled run), and the floor: weights + the
KV entries attended, read once at the measured copy bandwidth. With several --context values
and --attention backends (ddserve.engine.attention), every (backend, context) pair is a row
set, side by side in one run. --prefill N,...: the time to prefill one N-token prompt through
the engine (StaticEngine.prefill, graphs and each backend's chunk widths), per backend and
mode; with graphs also the fresh class in the widths of before (`COARSE`), without the fresh
class (the first chunk as any other) and without graphs, side by side. Writes NAME.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ddserve.bench.gpu_compare import copy_bandwidth
from ddserve.config.engine import LiveParams
from ddserve.engine.drafters import NoDrafter
from ddserve.engine.llama import LlamaConfig
from ddserve.engine.sampling import SamplingParams
from ddserve.engine.static import compile_layer_step, layer_step
from ddserve.engine.static_engine import StaticEngine
from ddserve.engine.static_models import StaticTarget, pack_target
from ddserve.engine.weights import load_model, random_llama

COARSE = (1024, 2048, 3072, 4096, 6144, 8192)  # the fresh widths until 2026-12-03

SMOLLM2 = LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    max_position=8192,
)


def inputs(st: StaticTarget, b: int, w: int, length: int) -> np.ndarray:
    tokens = np.random.default_rng(0).integers(0, st.model.cfg.vocab_size, (b, w))
    pos = np.tile(length + np.arange(w), (b, 1))
    tree = np.tile(np.tril(np.ones((w, w), dtype=bool)), (b, 1, 1))
    return pack_target(tokens, pos, pos, np.full(b, length), np.arange(b), tree)


def kernels_per_call(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    top = sorted(events, key=lambda e: -e.device_time_total)[:12]
    kernels_per_call.top = [
        (e.key[:60], e.count, round(e.device_time_total / 1e3, 3)) for e in top
    ]  # (name, launches, ms)
    return sum(e.count for e in events)


def measure(st, mode, b, w, ctx, length) -> dict:
    packed = inputs(st, b, w, length)
    st.graphs.enabled = mode != "eager"

    def call():
        _, top, _ = st.forward(packed, b, w, ctx, True)
        return top.cpu()

    t0 = time.perf_counter()
    call()  # capture (and compile) happen here
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(3):
        call()
    key = (True, b, w, ctx)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 50
    if mode == "eager":
        torch.cuda.synchronize()
        start.record()
        with torch.inference_mode():
            for _ in range(n):
                st._forward(st.inputs[key], key)
        end.record()
    else:
        graph = st.graphs.graphs[key][0]
        torch.cuda.synchronize()
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
    torch.cuda.synchronize()
    gpu_ms = start.elapsed_time(end) / n
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    call_ms = (time.perf_counter() - t0) / n * 1e3
    kernels = kernels_per_call(lambda: st._forward(st.inputs[key], key))
    return {
        "mode": mode,
        "batch": b,
        "width": w,
        "ctx": ctx,
        "first_call_s": round(first, 2),
        "step_gpu_ms": round(gpu_ms, 4),
        "step_call_ms": round(call_ms, 4),
        "kernels_per_step": kernels,
        "top_kernels_name_count_ms": kernels_per_call.top,
        "tokens_per_s_if_all_accepted_1": round(b / (call_ms / 1e3), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--context", default="256", help="committed entries per row (comma list)")
    ap.add_argument("--modes", default="eager,graph,compile")
    ap.add_argument("--attention", default="sdpa", help="comma list: sdpa, triton")
    ap.add_argument("--prefill", default="", help="prompt lengths to time a prefill of")
    ap.add_argument("--fused-tune", help="layer_kernels JSONs (comma list): their best parameters")
    ap.add_argument("--name", default="static_step")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ddserve.bench.static_step measures CUDA graphs: it needs a GPU")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.model == "random-smollm2":
        model = random_llama(SMOLLM2).to("cuda", torch.bfloat16)
    else:
        model = load_model(a.model, "cuda", torch.bfloat16, with_tokenizer=False).model
    batches = [int(x) for x in a.batches.split(",")]
    widths = [int(x) for x in a.widths.split(",")]
    bw = copy_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.cfg
    kv_bytes_per_entry = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    result = {
        "model": a.model,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_bandwidth_TBps": round(bw / 1e12, 3),
        "weight_bytes": weight_bytes,
        "command": "python -m ddserve.bench.static_step " + " ".join(sys.argv[1:]),
        "rows": [],
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    contexts = [int(x) for x in a.context.split(",")]
    prefills = [int(x) for x in a.prefill.split(",") if x]
    longest = max(contexts + prefills) + max(widths)
    modes = a.modes.split(",")
    any_tuned = any(m.endswith("+tuned") for m in modes)
    max_rows = None
    for spec in modes:
        mode = spec.removesuffix("+tuned")
        fused = mode.startswith("fused")
        layer_fn = compile_layer_step() if mode == "compile" or fused else layer_step
        if fused:
            from ddserve.engine import layer_launch, layer_triton

            # fused-nopdl: the same kernels without programmatic dependent launch;
            # fused-plain: without it and without the L2 prefetches; fused-overlap: with both
            # (fused: the engine's choice, layer_launch.OVERLAP_AUTO)
            on = True if mode == "fused-overlap" else None
            layer_launch.PDL = False if mode in ("fused-nopdl", "fused-plain") else on
            layer_launch.PREFETCH = False if mode == "fused-plain" else on

            # the best launch parameters of a bench.layer_kernels run: for modes named
            # MODE+tuned where there are any (beside the defaults, in one run), else for all
            max_rows = layer_launch.FUSED_MAX_ROWS if max_rows is None else max_rows
            layer_launch.TUNE.clear()
            layer_launch.SPLIT_K.clear()
            layer_launch.FUSED_MAX_ROWS = max_rows
            if a.fused_tune and (spec.endswith("+tuned") or not any_tuned):
                from ddserve.bench.tuned import apply_tune

                result["fused_tune"] = apply_tune(a.fused_tune)
            layer_fn = layer_triton.with_fused_layers(layer_fn)
        for attn in a.attention.split(","):
            st = StaticTarget(
                model, max(batches), longest, (), True, layer_fn=layer_fn, attention=attn
            )
            for length in contexts:
                ctx = st.ctx_bucket(length + max(widths))
                for b in batches:
                    for w in widths:
                        row = measure(st, spec, b, w, ctx, length)
                        floor = (weight_bytes + b * (length + w) * kv_bytes_per_entry) / bw * 1e3
                        row.update(attention=attn, context=length, floor_ms=round(floor, 4))
                        result["rows"].append(row)
                        print(
                            f"{spec:8s} {attn:6s} ctx={length:<5d} B={b:<3d} W={w:<3d} gpu "
                            f"{row['step_gpu_ms']:.3f} ms  call {row['step_call_ms']:.3f} ms  "
                            f"kernels {row['kernels_per_step']}  floor {floor:.3f} ms  "
                            f"first {row['first_call_s']} s",
                            flush=True,
                        )
                        (out / f"{a.name}.json").write_text(json.dumps(result, indent=1))
            del st
            torch.cuda.empty_cache()
            if prefills and not fused:  # prefill is wide: never fused
                result.setdefault("prefill", []).extend(
                    time_prefill(model, mode, attn, prefills, longest)
                )
                (out / f"{a.name}.json").write_text(json.dumps(result, indent=1))


def time_prefill(model, mode: str, attn: str, lengths: list[int], longest: int) -> list[dict]:
    """Wall time of StaticEngine.prefill of one prompt per length, on an engine warmed up as a
    served one is (then chunks of shapes not captured run without graphs), after one untimed
    prefill of the same length, median of 5; then one more under the profiler: its kernels
    and the 12 that took the most GPU time."""
    eng = StaticEngine(
        model,
        NoDrafter(),
        1,
        (),
        slots=1,
        max_context=max(longest, 8192),  # as served (`ddserve engine --max-context 8192`)
        graphs=mode != "eager",
        compile=mode == "compile",
        attention=attn,
    )
    eng.warm_up(LiveParams(budget=0))  # as served: chunks of shapes not captured run eagerly
    rows = []
    rng = np.random.default_rng(0)
    as_served, fresh = eng.target.prefill_eager, eng.fresh_chunks
    paths = ["served", "coarse", "no-fresh", "no-graph"]
    paths = paths if eng.target.graphs.enabled else ["served"]
    for n, path in ((n, p) for n in lengths for p in paths):
        # "coarse": the fresh class in the widths of before (those served: captured);
        # "no-fresh": the first chunk in the other classes' widths and attention, as before
        # the fresh class; "no-graph": every chunk without a graph (exact widths), as before
        # the warm-up captured prompt chunks for every context (triton); side by side
        eng.target.prefill_eager = as_served if path != "no-graph" else (lambda key: True)
        widths = {"served": fresh, "coarse": COARSE}.get(path, ())
        eng.fresh_chunks = tuple(w for w in widths if w in fresh)
        prompt = rng.integers(3, model.cfg.vocab_size, n + 1).tolist()
        times = []
        for i in range(6):
            seq = eng.new_sequence(prompt, SamplingParams(max_tokens=1))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.prefill(seq)
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
            eng.release(seq)
        ms = float(np.median(times)) * 1e3
        seq = eng.new_sequence(prompt, SamplingParams(max_tokens=1))
        kernels = kernels_per_call(lambda s=seq, e=eng: e.prefill(s))  # where the GPU time goes
        eng.release(seq)
        rows.append(
            {
                "mode": mode,
                "attention": attn,
                "prompt_tokens": n,
                "prefill_path": path,
                "prefill_ms": round(ms, 3),
                "kernels": kernels,
                "top_kernels_name_count_ms": kernels_per_call.top,
            }
        )
        print(f"{mode:8s} {attn:6s} prefill {n:5d} tokens ({path}): {ms:.2f} ms", flush=True)
    del eng
    torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
