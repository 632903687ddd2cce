"""Builtin engine on this machine: tok/s and tau per tree config, cold start, peak RSS.

    python -m bench.engine_cpu [--model smollm2-135m] [--max-tokens 96] [--out bench/results] [--with-layer-skip]

Prints a table and writes engine_cpu.json (and engine_cpu.png when matplotlib is present).
Greedy decoding, so every config produces the same tokens (lossless) and only speed differs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from bench.prompts import CHAT_PROMPTS
from service.config import LiveParams
from service.engine.ddtree import DDTreeEngine
from service.engine.drafters import ModelDrafter, NGramDrafter, NoDrafter
from service.engine.sampling import SamplingParams
from service.engine.weights import load_model

CONFIGS = [
    ("AR (budget 0)", "none", 0, 1),
    ("ngram b4 k2", "ngram", 4, 2),
    ("ngram b8 k4", "ngram", 8, 4),
    ("ngram b16 k4", "ngram", 16, 4),
    ("ngram b8 k1", "ngram", 8, 1),
]
LAYER_SKIP = ("layer-skip(12) b6 k2", "layer-skip", 6, 2)  # ~5x slower than AR here: opt-in


def engine_runs(
    model_spec: str, max_tokens: int, temperature: float, configs: list[tuple]
) -> list[dict]:
    lm = load_model(model_spec)
    m, tok = lm.model, lm.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)[
            "input_ids"
        ]
        for p in CHAT_PROMPTS
    ]
    rows, ref = [], None
    for name, kind, budget, topk in configs:
        drafter = {
            "none": NoDrafter(),
            "ngram": NGramDrafter(m.cfg.vocab_size),
            "layer-skip": ModelDrafter(m, 12, "layer-skip"),
        }[kind]
        eng = DDTreeEngine(m, drafter, 8, m.cfg.eos_token_ids)
        eng.generate(
            prompts[0][:8], SamplingParams(max_tokens=4), LiveParams(budget=budget, topk=topk)
        )  # warm-up
        toks = rounds = 0
        wall = draft = verify = 0.0
        outs = []
        for i, p in enumerate(prompts):
            t0 = time.perf_counter()
            seq = eng.generate(
                p,
                SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i),
                LiveParams(budget=budget, topk=topk),
            )
            wall += time.perf_counter() - t0 - seq.stats.prefill_s
            toks += len(seq.output)
            rounds += seq.stats.verify_rounds
            draft += seq.stats.draft_s
            verify += seq.stats.verify_s
            outs.append(seq.output)
        ref = ref or outs
        rows.append(
            {
                "config": name,
                "drafter": kind,
                "budget": budget,
                "topk": topk,
                "temperature": temperature,
                "tokens": toks,
                "decode_tok_s": round(toks / wall, 2),
                "tau": round(toks / rounds, 3),
                "draft_ms_per_round": round(draft / rounds * 1e3, 2),
                "verify_ms_per_round": round(verify / rounds * 1e3, 2),
                "same_as_ar": outs == ref if temperature == 0 else None,
            }
        )
        print(
            f"  {name:24s} {rows[-1]['decode_tok_s']:7.2f} tok/s  tau {rows[-1]['tau']:.2f}",
            flush=True,
        )
    return rows


def cold_start(model_spec: str) -> dict:
    """Process start -> first streamed token, and the server's peak RSS over a few requests."""
    port = 30000 + os.getpid() % 20000
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "engine", "--model", model_spec, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                httpx.get(url + "/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.perf_counter() - t0 > 300:
                    raise RuntimeError("engine did not start") from None
                time.sleep(0.05)
        body = {
            "model": model_spec,
            "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 32,
            "stream": True,
        }
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break
        first_token = time.perf_counter() - t0
        for p in CHAT_PROMPTS[:3]:
            httpx.post(
                url + "/v1/chat/completions",
                json={
                    "model": model_spec,
                    "messages": [{"role": "user", "content": p}],
                    "max_tokens": 64,
                },
                timeout=300,
            )
        status = Path(f"/proc/{proc.pid}/status").read_text()
        hwm = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmHWM"))
    finally:
        proc.terminate()
        proc.wait(30)
    return {
        "cold_start_to_first_token_s": round(first_token, 2),
        "peak_rss_mib": round(hwm / 1024, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument(
        "--with-layer-skip",
        action="store_true",
        help="also measure the layer-skip drafter (greedy)",
    )
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = {
        "model": a.model,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "max_tokens": a.max_tokens,
        "prompts": len(CHAT_PROMPTS),
    }
    print("greedy (T=0):")
    result["greedy"] = engine_runs(
        a.model, a.max_tokens, 0.0, CONFIGS + ([LAYER_SKIP] if a.with_layer_skip else [])
    )
    print("sampled (T=1):")
    result["sampled"] = engine_runs(
        a.model, a.max_tokens, 1.0, [CONFIGS[0], CONFIGS[1], CONFIGS[2]]
    )
    result["server"] = cold_start(a.model)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_cpu.json").write_text(json.dumps(result, indent=1))
    print(
        f"\n{'config':24s} {'T':>4s} {'tok/s':>8s} {'tau':>6s} {'draft ms':>9s} {'verify ms':>10s}  lossless"
    )
    for row in result["greedy"] + result["sampled"]:
        print(
            f"{row['config']:24s} {row['temperature']:4.1f} {row['decode_tok_s']:8.2f} {row['tau']:6.2f} {row['draft_ms_per_round']:9.2f} {row['verify_ms_per_round']:10.2f}  {row['same_as_ar']}"
        )
    print(
        f"cold start to first token {result['server']['cold_start_to_first_token_s']} s, peak RSS {result['server']['peak_rss_mib']} MiB"
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        names = [r["config"] for r in result["greedy"]]
        ax.bar([n + "\nT=0" for n in names], [r["decode_tok_s"] for r in result["greedy"]])
        ax.set_ylabel("decode tok/s")
        ax.set_title(f"{a.model} on {result['machine']}")
        plt.xticks(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "engine_cpu.png", dpi=100)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
