"""`python bench/one_engine_ab.py PROMPTS MAX_TOKENS PASSES` (from a checkout).

A/B on CPU, SmolLM2, DFlash budget 3 topk 1, greedy: the old dynamic engine (its code is
tests/engine/reference.py: ReferenceEngine + ReferenceDFlash, unchanged computation) vs the
one engine (StaticEngine, runner defaults: 32 slots, model max context, graphs off).
Alternates engine order per prompt; decode tok/s (prefill excluded) per pass; median ratio."""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # the checkout: tests/ holds the reference
from ddserve.bench.prompts import CHAT_PROMPTS, chat_ids
from ddserve.config.engine import LiveParams
from ddserve.engine.dflash import BUILTIN, DFlashDrafter, load_dflash, load_draft_vocab
from ddserve.engine.sampling import SamplingParams
from ddserve.engine.static_engine import StaticEngine
from ddserve.engine.weights import load_model
from tests.engine.reference import ReferenceDFlash, ReferenceEngine

t0 = time.time()
lm = load_model("smollm2-135m", "cpu", torch.float32)
m = lm.model
print("loaded", round(time.time() - t0, 1), "max_position", m.cfg.max_position, flush=True)
path = BUILTIN["smollm2-135m"]


def mk(cls):
    return cls(load_dflash(path), m, load_draft_vocab(path))


eos = m.cfg.eos_token_ids
engines = {
    "dynamic": ReferenceEngine(m, mk(ReferenceDFlash), 8, eos),
    "one": StaticEngine(
        m, mk(DFlashDrafter), 8, eos, slots=32, max_context=m.cfg.max_position, graphs=False
    ),
}
P = LiveParams(budget=3, topk=1)
prompts = chat_ids(lm.tokenizer, list(CHAT_PROMPTS))
n_prompts = int(sys.argv[1])
mt = int(sys.argv[2])
passes = int(sys.argv[3])
prompts = prompts[:n_prompts]
for e in engines.values():
    e.generate(prompts[0][:8], SamplingParams(max_tokens=4), P)
print("warm", flush=True)
res = {k: [] for k in engines}
for rep in range(passes):
    toks = {k: 0 for k in engines}
    wall = {k: 0.0 for k in engines}
    outs = {k: [] for k in engines}
    for i, p in enumerate(prompts):
        order = list(engines) if (i + rep) % 2 == 0 else list(engines)[::-1]
        for name in order:
            t0 = time.perf_counter()
            seq = engines[name].generate(p, SamplingParams(max_tokens=mt), P)
            wall[name] += time.perf_counter() - t0 - seq.stats.prefill_s
            toks[name] += len(seq.output)
            outs[name].append(seq.output)
    for k in engines:
        res[k].append(toks[k] / wall[k])
    print(
        f"pass {rep}: " + "  ".join(f"{k} {res[k][-1]:.2f} tok/s" for k in engines),
        f" ratio one/dynamic {res['one'][-1] / res['dynamic'][-1]:.3f}",
        " same outputs:",
        outs["dynamic"] == outs["one"],
        flush=True,
    )
md, mo = statistics.median(res["dynamic"]), statistics.median(res["one"])
print(f"median dynamic {md:.2f}  one {mo:.2f}  one/dynamic {mo / md:.3f}", flush=True)
