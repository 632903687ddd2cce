"""Builtin engine: tok/s and tau per drafter and tree config, cold start, peak RSS.

    python -m ddserve.bench.engine_cpu [--model smollm2-135m] [--max-tokens 96] [--out bench/results]
        [--configs ar,ngram-b4k2,...] [--prompt-set chat|heldout] [--device cpu|cuda]
        [--dflash DIR] [--name engine_cpu] [--no-server] [--dtype float32|bfloat16]

Prints a table and writes NAME.json (and NAME.png when matplotlib is present). Greedy runs
must produce the same tokens for every config (lossless; the table says so per row).
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

from ddserve.bench.prompts import CHAT_PROMPTS, chat_ids, named_set
from ddserve.config.engine import LiveParams
from ddserve.engine.dflash import BUILTIN, DFlashDrafter, load_dflash, load_draft_vocab
from ddserve.engine.drafters import ModelDrafter, NGramDrafter, NoDrafter
from ddserve.engine.sampling import SamplingParams
from ddserve.engine.static_engine import StaticEngine
from ddserve.engine.weights import load_model
from ddserve.errors import EngineUnavailable

# name -> (drafter kind, budget, topk)
REGISTRY = {
    "ar": ("none", 0, 1),
    "ngram-b4k2": ("ngram", 4, 2),
    "ngram-b8k4": ("ngram", 8, 4),
    "ngram-b16k4": ("ngram", 16, 4),
    "ngram-b8k1": ("ngram", 8, 1),
    "layer-skip12-b6k2": ("layer-skip", 6, 2),  # ~5x slower than AR on CPU: opt-in
    "dflash-full-b4k1": ("dflash-fullvocab", 4, 1),  # without the draft vocabulary subset
    "dflash-full-b8k2": ("dflash-fullvocab", 8, 2),
    "dflash-b2k1": ("dflash", 2, 1),
    "dflash-b3k1": ("dflash", 3, 1),
    "dflash-b4k1": ("dflash", 4, 1),
    "dflash-b6k1": ("dflash", 6, 1),
    "dflash-b4k2": ("dflash", 4, 2),
    "dflash-b8k1": ("dflash", 8, 1),
    "dflash-b8k2": ("dflash", 8, 2),
    "dflash-b15k4": ("dflash", 15, 4),  # 16 rows a verify: the fused layers (b16k4: 17, 32 wide)
    "dflash-b16k4": ("dflash", 16, 4),
    "dflash-b3k4": ("dflash", 3, 4),  # with b7k4: the adaptive candidates under b16k4
    "dflash-b7k4": ("dflash", 7, 4),
    "dflash-b0": ("dflash", 0, 1),  # the DFlash engine at budget 0: AR rounds, same graphs
    "dflash-b32k4": ("dflash", 32, 4),
    "dflash-b64k8": ("dflash", 64, 8),
}
DEFAULT_GREEDY = ["ar", "ngram-b4k2", "ngram-b8k4", "ngram-b16k4", "ngram-b8k1"]
DEFAULT_SAMPLED = ["ar", "ngram-b4k2", "ngram-b8k4"]


def make_drafter(kind: str, m, dflash_dir: str | None):
    if kind == "none":
        return NoDrafter()
    if kind == "ngram":
        return NGramDrafter(m.cfg.vocab_size)
    if kind == "layer-skip":
        return ModelDrafter(m, 12, "layer-skip")
    path = dflash_dir or BUILTIN["smollm2-135m"]
    vocab = None if kind == "dflash-fullvocab" else load_draft_vocab(path)
    return DFlashDrafter(load_dflash(path), m, vocab)


def steps_mode(mode: str) -> bool:
    """Whether a config's mode is `stepsN` (--num-scheduler-steps N)."""
    return mode.startswith("steps") and mode[5:].isdigit()


def steps_of(modes: list[str]) -> int:
    """N of a config's `@stepsN` mode, else 1."""
    return next((int(m[5:]) for m in modes if steps_mode(m)), 1)


def load_on(model: str, device: str, prompts: str):
    """The model on `device` ("auto": cuda where there is one) in the dtype the engine serves
    it in (bf16 on a GPU, fp32 on CPU) and a prompt set's token ids, for the engine-only
    benchmarks. Returns (loaded model, prompt ids, the machine in words)."""
    device = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lm = load_model(model, device, dtype)
    return lm, chat_ids(lm.tokenizer, prompt_set(prompts)), machine_name(device)


def machine_name(device: str) -> str:
    """The machine in words, for a result's `machine` field."""
    dev = torch.cuda.get_device_name() if device == "cuda" else f"{os.cpu_count()} cores"
    return f"{platform.machine()} {dev}, torch {torch.__version__}"


def prompt_set(name: str) -> list[str]:
    if name in ("chat", "humaneval", "mixed"):
        return named_set(name)
    from ddserve.training.prompts import heldout_prompts

    held = heldout_prompts()  # 8 chat prompts, then held-out HumanEval problems
    return held if name == "heldout" else held[: int(name.split(":")[1])]


def engine_runs(
    lm,
    texts: list[str],
    max_tokens: int,
    temperature: float,
    configs: list[str],
    dflash=None,
) -> list[dict]:
    m, tok = lm.model, lm.tokenizer
    prompts = chat_ids(tok, texts)
    rows, ref = [], None
    against_ar = bool(configs) and configs[0].split("@")[0] == "ar"
    for name in configs:
        # @nofused: torch's layers (no fused triton kernels); @fused: fused also where auto
        # would not (fp32: the kernels' exact products against the reference); @stepsN: N
        # decoding steps (or DDTree rounds) a host round trip (--num-scheduler-steps)
        base, *modes = name.split("@")
        steps = steps_of(modes)
        kind, budget, topk = REGISTRY[base]
        drafter = make_drafter(kind, m, dflash)
        gpu = m.device.type == "cuda"  # CUDA graphs and torch.compile on a GPU, as served
        eng = StaticEngine(
            m,
            drafter,
            8,
            m.cfg.eos_token_ids,
            slots=1,
            max_context=2048,
            graphs=gpu,
            compile=gpu,
            fused_layers="off" if "nofused" in modes else ("on" if "fused" in modes else "auto"),
            scheduler_steps=steps,
        )
        eng.warm_up(LiveParams(budget=budget, topk=topk))
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
        if m.device.type == "cuda":
            torch.cuda.synchronize()
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
                # greedy: prompts whose output equals AR's token for token (AR: the first
                # config; None without AR first: nothing to compare with)
                "same_as_ar": (
                    f"{sum(o == r for o, r in zip(outs, ref, strict=True))}/{len(outs)}"
                    if temperature == 0 and against_ar
                    else None
                ),
                "divergences": (
                    divergences(m, prompts, ref, outs) if temperature == 0 and against_ar else None
                ),
            }
        )
        print(
            f"  {name:24s} {rows[-1]['decode_tok_s']:7.2f} tok/s  tau {rows[-1]['tau']:.2f}",
            flush=True,
        )
    return rows


@torch.inference_mode()
def divergences(m, prompts, ref, outs) -> list[dict]:
    """Where a greedy output leaves the AR reference: the token index and the gap between
    the two tokens' logits there (the reference prefix re-run through the dynamic forward).
    A gap at the dtype's resolution (bf16: ~0.06-0.125 at logit sizes 10-30) is a tie that
    different kernel shapes may break either way."""
    found = []
    for k, (p, r, o) in enumerate(zip(prompts, ref, outs, strict=True)):
        if o == r:
            continue
        i = next((j for j, (a, b) in enumerate(zip(r, o, strict=False)) if a != b), None)
        if i is None:
            continue
        toks = torch.tensor(p + r[:i], device=m.device)
        logits = m(
            toks,
            torch.arange(len(toks), device=m.device),
            m.new_cache(len(toks) + 8),
            last_only=True,
        )[-1].float()
        found.append(
            {
                "prompt": k,
                "index": i,
                "ar_token": r[i],
                "token": o[i],
                "logit_gap": round(float(logits[r[i]] - logits[o[i]]), 4),
            }
        )
    return found


def cold_start(model_spec: str) -> dict:
    """Process start -> first streamed token, and the server's peak RSS over a few requests."""
    port = 30000 + os.getpid() % 20000
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddserve", "engine", "--model", model_spec, "--port", str(port)],
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
                    raise EngineUnavailable("engine did not start") from None
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
    ap.add_argument("--configs", default=",".join(DEFAULT_GREEDY), help="greedy configs")
    ap.add_argument("--sampled-configs", default=",".join(DEFAULT_SAMPLED), help="T=1 configs")
    ap.add_argument("--prompt-set", default="chat", help="chat | heldout | heldout:N")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dflash", help="DFlash drafter directory (default: the builtin one)")
    ap.add_argument("--name", default="engine_cpu", help="results file stem")
    ap.add_argument("--no-server", action="store_true", help="skip the cold-start/RSS run")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bf16 on cuda")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for c in (a.configs + "," + a.sampled_configs).split(","):
        if c and c.split("@")[0] not in REGISTRY:
            sys.exit(f"unknown config {c!r}; known: {', '.join(REGISTRY)}")
    texts = prompt_set(a.prompt_set)
    dtype = getattr(torch, a.dtype) if a.dtype else None
    dtype = dtype or (torch.bfloat16 if a.device == "cuda" else torch.float32)
    lm = load_model(a.model, a.device, dtype)
    dev = torch.cuda.get_device_name() if a.device == "cuda" else f"{os.cpu_count()} cores"
    result = {
        "model": a.model,
        "machine": f"{platform.machine()} {dev}, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "dtype": str(dtype),
        "max_tokens": a.max_tokens,
        "prompt_set": a.prompt_set,
        "prompts": len(texts),
        "command": "python -m ddserve.bench.engine_cpu " + " ".join(sys.argv[1:]),
    }
    print("greedy (T=0):")
    result["greedy"] = engine_runs(lm, texts, a.max_tokens, 0.0, a.configs.split(","), a.dflash)
    print("sampled (T=1):")
    sampled = [c for c in a.sampled_configs.split(",") if c]
    result["sampled"] = engine_runs(lm, texts, a.max_tokens, 1.0, sampled, a.dflash)
    if not a.no_server:
        result["server"] = cold_start(a.model)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(result, indent=1))
    print(
        f"\n{'config':24s} {'T':>4s} {'tok/s':>8s} {'tau':>6s} {'draft ms':>9s} {'verify ms':>10s}  lossless"
    )
    for row in result["greedy"] + result["sampled"]:
        print(
            f"{row['config']:24s} {row['temperature']:4.1f} {row['decode_tok_s']:8.2f} {row['tau']:6.2f} {row['draft_ms_per_round']:9.2f} {row['verify_ms_per_round']:10.2f}  {row['same_as_ar']}"
        )
    if "server" in result:
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
        fig.savefig(out / f"{a.name}.png", dpi=100)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
