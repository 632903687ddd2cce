"""Hugging Face generation next to our engine on one GPU, and the physical floors.

    python -m ddserve.bench.gpu_compare [--model smollm2-135m] [--max-tokens 128] [--out DIR]
        [--device cuda|cpu] [--skip NAME,...] [--name gpu_compare]

On CPU (fp32) the floors and the profile are skipped (they are CUDA measurements).

Same weights (our converted model handed to transformers with `to_hf`), same chat prompts,
bf16, greedy, one request at a time unless said. Measures:
  hf_eager            model.generate, dynamic cache
  hf_static_compile   generate with cache_implementation="static" (transformers compiles the
                      decode step itself); compile time reported apart, excluded from tok/s
  hf_prompt_lookup    assisted generation, prompt_lookup_num_tokens=10
  hf_eager_batch64    64 prompts in one batch (left padded): total tok/s
  floors              device-to-device copy bandwidth -> weight-read time per step; kernels
                      launched per decode step of our engine (profiler) and the replay time of a
                      CUDA graph of that many small kernels (the launch-bound floor)
Writes gpu_compare.json; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from ddserve.bench.prompts import CHAT_PROMPTS, chat_ids
from ddserve.config.engine import LiveParams
from ddserve.engine.drafters import NoDrafter
from ddserve.engine.sampling import SamplingParams
from ddserve.engine.static_engine import StaticEngine
from ddserve.engine.weights import load_model, to_hf


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_single(hf, prompts, max_new, **kw) -> dict:
    """Per-prompt generate; decode tok/s excludes nothing but a warm-up prompt."""
    dev = hf.device
    ids0 = torch.tensor([prompts[0]], device=dev)
    hf.generate(ids0, max_new_tokens=8, do_sample=False, **kw)  # warm-up
    toks, wall = 0, 0.0
    for p in prompts:
        ids = torch.tensor([p], device=dev)
        sync()
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=max_new, do_sample=False, **kw)
        sync()
        wall += time.perf_counter() - t0
        toks += out.shape[1] - ids.shape[1]
    return {"tokens": toks, "seconds": round(wall, 3), "tok_s": round(toks / wall, 1)}


def hf_batch(hf, prompts, max_new, pad) -> dict:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    att = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        att[r, width - len(p) :] = 1
    ids, att = ids.to(hf.device), att.to(hf.device)
    kw = dict(attention_mask=att, do_sample=False, pad_token_id=pad)
    hf.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
    sync()
    t0 = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, **kw)
    sync()
    wall = time.perf_counter() - t0
    toks = (out.shape[1] - width) * len(prompts)
    return {
        "batch": len(prompts),
        "tokens": toks,
        "seconds": round(wall, 3),
        "tok_s": round(toks / wall, 1),
    }


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 20)."""
    a = torch.randn(512 * 2**20, device="cuda", dtype=torch.float32)  # 2 GiB
    b = torch.empty_like(a)
    times = []
    for _ in range(23):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        sync()
        times.append(s.elapsed_time(e) / 1e3)
    t = sorted(times[3:])[10]
    return 2 * a.numel() * 4 / t


def graph_launch_floor(n_kernels: int) -> float:
    """Seconds to replay a CUDA graph of n small dependent kernels (the launch-bound floor)."""
    x = torch.randn(576, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            y = x
            for _ in range(n_kernels):
                y = y * 1.0001
    sync()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x
        for _ in range(n_kernels):
            y = y * 1.0001
    g.replay()
    sync()
    t0 = time.perf_counter()
    for _ in range(50):
        g.replay()
    sync()
    return (time.perf_counter() - t0) / 50


def our_step_profile(lm, prompt) -> dict:
    """Kernels per AR decode step of our engine, host and device time per step."""
    from torch.profiler import ProfilerActivity, profile

    m = lm.model
    eng = StaticEngine(
        m, NoDrafter(), 1, m.cfg.eos_token_ids, slots=1, max_context=2048, graphs=True
    )
    seq = eng.new_sequence(prompt, SamplingParams(max_tokens=10_000, ignore_eos=True))
    eng.prefill(seq)
    params = LiveParams(budget=0)
    for _ in range(5):
        eng.step(seq, params)
    sync()
    t0 = time.perf_counter()
    n = 50
    for _ in range(n):
        eng.step(seq, params)
    sync()
    per_step = (time.perf_counter() - t0) / n
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            eng.step(seq, params)
        sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time for e in kernels) / 5
    return {
        "ar_step_ms": round(per_step * 1e3, 3),
        "kernels_per_step": len(kernels) // 5,
        "gpu_busy_ms_per_step": round(gpu_us / 1e3, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--skip", default="", help="comma list of measurements to skip")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--name", default="gpu_compare")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    skip = set(a.skip.split(","))
    cuda = a.device == "cuda"
    if not cuda:
        skip |= {"floors", "our_ar_profile"}
    dtype = torch.bfloat16 if cuda else torch.float32
    lm = load_model(a.model, a.device, dtype)
    tok = lm.tokenizer
    prompts = chat_ids(tok, CHAT_PROMPTS)
    hf = to_hf(lm.model, dtype)
    hf.generation_config.pad_token_id = tok.pad_token_id or lm.model.cfg.eos_token_ids[0]
    res = {
        "model": a.model,
        "device": torch.cuda.get_device_name()
        if cuda
        else f"cpu, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "max_new_tokens": a.max_tokens,
        "prompts": len(prompts),
    }
    import transformers

    res["transformers"] = transformers.__version__

    def record(name, fn):
        if name in skip:
            return
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as exc:  # report, keep measuring the rest
            res[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        res[name]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(name, json.dumps(res[name]), flush=True)

    record("floors", lambda: {"copy_bytes_per_s": copy_bandwidth()})
    if cuda:
        bw = res["floors"].get("copy_bytes_per_s")
        weight_bytes = sum(p.numel() * p.element_size() for p in lm.model.parameters())
        res["floors"]["weight_bytes"] = weight_bytes
        if bw:
            res["floors"]["weight_read_ms"] = round(weight_bytes / bw * 1e3, 4)
    record("our_ar_profile", lambda: our_step_profile(lm, prompts[0]))
    nk = res.get("our_ar_profile", {}).get("kernels_per_step")
    if nk:
        res["floors"]["graph_launch_floor_ms"] = round(graph_launch_floor(nk) * 1e3, 4)
    record("hf_eager", lambda: hf_single(hf, prompts, a.max_tokens))
    record(
        "hf_prompt_lookup",
        lambda: hf_single(hf, prompts, a.max_tokens, prompt_lookup_num_tokens=10),
    )

    def static():
        t0 = time.perf_counter()
        ids0 = torch.tensor([prompts[0]], device=a.device)
        for _ in range(2):  # compile + cudagraph warm-up
            hf.generate(
                ids0, max_new_tokens=a.max_tokens, do_sample=False, cache_implementation="static"
            )
        sync()
        out = hf_single(hf, prompts, a.max_tokens, cache_implementation="static")
        out["compile_warmup_s"] = round(time.perf_counter() - t0 - out["seconds"], 1)
        return out

    record("hf_static_compile", static)
    pad = hf.generation_config.pad_token_id
    record("hf_eager_batch64", lambda: hf_batch(hf, (prompts * 8)[:64], a.max_tokens, pad))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(res, indent=1))
    print(f"\n{'measurement':22s} {'tok/s':>10s}")
    for k in ("hf_eager", "hf_static_compile", "hf_prompt_lookup", "hf_eager_batch64"):
        if k in res:
            print(f"{k:22s} {res[k].get('tok_s', res[k].get('error', ''))!s:>10s}")
    if cuda:
        print(
            "floors", json.dumps(res["floors"]), "our AR profile", json.dumps(res["our_ar_profile"])
        )


if __name__ == "__main__":
    main()
