"""Which DDTree verify shapes make the static engine report non-finite logits on a GPU.

    python -m ddserve.bench.nonfinite_probe [--prompts 16] [--max-tokens 128] [--out DIR]

The adaptive runner (bench.engine_load `dflash-b15k4@adaptive`, an H100, bf16) ended 6-32
requests a level with "the target produced non-finite logits" where fixed-budget runs of the
same prompts ended none. This runs the engine the runner runs (CUDA graphs, compiled glue,
the builtin drafter, bf16) on the held-out prompts with fixed budgets 1/3/7/15 and with the
budget changing every round as the adaptive policy changes it, and reports per schedule the
requests that failed and the first failing round's budget and round index. Run it under
`bench.tuned` with a split-K JSON to see whether a kernel setting is the cause."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ddserve.bench.engine_cpu import load_on, make_drafter
from ddserve.bench.round_profile import random_smollm2
from ddserve.config.engine import LiveParams
from ddserve.engine.sampling import SamplingParams
from ddserve.engine.static_engine import StaticEngine

SCHEDULES = {
    "b1": [1],
    "b3": [3],
    "b7": [7],
    "b15": [15],
    "cycle": [15, 7, 3, 1, 0, 15, 15, 3, 7, 0, 0, 15, 1, 7],
}


def run(eng, prompts, schedule, max_tokens) -> dict:
    failed, first = 0, None
    for i, p in enumerate(prompts):
        seq = eng.new_sequence(p, SamplingParams(max_tokens=max_tokens))
        eng.prefill(seq)
        r = 0
        try:
            while not seq.finished:
                budget = schedule[r % len(schedule)]
                out = eng.step_batch([seq], LiveParams(budget=budget, topk=4))[0]
                if isinstance(out, Exception):
                    failed += 1
                    first = first or {
                        "prompt": i,
                        "round": r,
                        "budget": budget,
                        "len": len(seq.tokens),
                    }
                    break
                r += 1
        finally:
            eng.release(seq)
    return {"failed": failed, "of": len(prompts), "first": first}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="smollm2-135m", help="or random-smollm2 (no GGUF)")
    ap.add_argument("--name", default="nonfinite")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    if a.model == "random-smollm2":
        lm, prompts, machine = random_smollm2(a.device)
        prompts = prompts[: a.prompts]
    else:
        lm, prompts, machine = load_on(a.model, a.device, f"heldout:{a.prompts}")
    m = lm.model
    eng = StaticEngine(
        m,
        make_drafter("dflash", m, None),
        8,
        m.cfg.eos_token_ids,
        slots=4,
        max_context=2048,
        graphs=a.device == "cuda",
        compile=a.device == "cuda",
        scheduler_steps=a.steps,
    )
    for b in (0, 1, 3, 7, 15):
        eng.warm_up(LiveParams(budget=b, topk=4))
    rows = {}
    for name, schedule in SCHEDULES.items():
        t0 = time.perf_counter()
        rows[name] = run(eng, prompts, schedule, a.max_tokens)
        rows[name]["s"] = round(time.perf_counter() - t0, 1)
        print(name, rows[name], flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    res = {"machine": machine, "steps": a.steps, "command": " ".join(sys.argv), "rows": rows}
    (Path(a.out) / f"{a.name}.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
