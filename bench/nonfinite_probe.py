"""Which DDTree verify shapes make the static engine report non-finite logits on a GPU.

    python -m ddserve.bench.nonfinite_probe [--model random-smollm2] [--batches 1,2]
        [--attention auto|sdpa|triton] [--fused-layers auto|off] [--graphs on|off] [--steps 4]
        [--prompts 16] [--max-tokens 128] [--name N] [--out DIR]

On an H100 (twenty-eighth session, bf16, the builtin drafter) the in-process runner with
adaptive speculation (`bench.engine_load dflash-b15k4@adaptive`) ended 18 of 32 requests at
C=1, all 32 at C=2 and 4 of 64 at C=16 with "the target produced non-finite logits", where
the fixed b15/k4 runs of the same prompts (C=1 in-process, C=1/4 served) ended none. The
adaptive runs change the budget round by round (15, 7, 3, 1, 0): verify widths 16, 8, 4, 2
and 1 where the fixed runs verify 16. On this CPU the same schedules (fp32, trees by the
kernel's host oracle, and the fused layers and attention in triton's interpreter) end none.

This runs the engine the runner runs (CUDA graphs, fused layers, triton attention, trees on
the GPU) on the prompts in groups of B (`--batches`: requests decoded together, B slots
busy) with fixed budgets 1/3/7/15 and with the budget changing every round as the adaptive
policy changes it, and prints per schedule and B the requests that failed and the first
failing round (budget, round, context length). Its switches take the suspects out one at a
time: `--attention sdpa`, `--fused-layers off`, `--graphs off`, and split-K off by running
it under `bench.tuned bench/lease/unsplit_all.json`; `--steps 4` runs the calls as rounds a
trip (budget 0: plain steps), as the adaptive runs at 4 steps did (they failed too).
Requests ended by an exception of the shared part count as failed, with its message.
Every forward shape is captured in the warm-up, budget by budget (0, 1, 3, 7, 15), in the
order the adaptive engine's start-up captures them."""

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


def run(eng, prompts, schedule, max_tokens: int, batch: int) -> dict:
    """The prompts `batch` at a time, decoded together under the budget `schedule` (one a
    round, cycled): {failed, of, first: where the first failure happened}."""
    failed, first = 0, None
    for g in range(0, len(prompts), batch):
        seqs = [
            eng.new_sequence(p, SamplingParams(max_tokens=max_tokens))
            for p in prompts[g : g + batch]
        ]
        try:
            eng.prefill_batch(seqs)
            r = 0
            while live := [s for s in seqs if not s.finished]:
                budget = schedule[r % len(schedule)]
                try:
                    outs = eng.step_batch(live, LiveParams(budget=budget, topk=4))
                except Exception as exc:  # noqa: BLE001 - the shared part: every one fails
                    outs = [exc] * len(live)
                for seq, out in zip(live, outs, strict=True):
                    if isinstance(out, Exception):
                        failed += 1
                        first = first or {
                            "prompt": g + seqs.index(seq),
                            "round": r,
                            "budget": budget,
                            "batch": len(live),
                            "len": len(seq.tokens),
                            "error": str(out)[:80],
                        }
                r += 1
        finally:
            for seq in seqs:
                eng.release(seq)
    return {"failed": failed, "of": len(prompts), "first": first}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="or random-smollm2 (no GGUF)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,2", help="requests decoded together")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="of " + ",".join(SCHEDULES))
    ap.add_argument("--attention", default="auto", choices=("auto", "sdpa", "triton"))
    ap.add_argument("--fused-layers", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--graphs", default="on", choices=("on", "off"))
    ap.add_argument("--steps", type=int, default=1, help="--num-scheduler-steps (4: rounds a trip)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--name", default="nonfinite")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    try:
        batches = [int(x) for x in a.batches.split(",")]
    except ValueError:
        sys.exit(f"--batches {a.batches!r}: expected integers like 1,2")
    if bad := set(a.schedules.split(",")) - set(SCHEDULES):
        sys.exit(f"--schedules: unknown {sorted(bad)}; known: {', '.join(SCHEDULES)}")
    if a.model == "random-smollm2":
        lm, prompts, machine = random_smollm2(a.device)
        prompts = prompts[: a.prompts]
    else:
        lm, prompts, machine = load_on(a.model, a.device, f"heldout:{a.prompts}")
    m = lm.model
    gpu = a.device == "cuda"
    eng = StaticEngine(
        m,
        make_drafter("dflash", m, None),
        8,
        m.cfg.eos_token_ids,
        slots=max(batches),
        max_context=2048,
        graphs=gpu and a.graphs == "on",
        compile=gpu,
        attention=a.attention,
        fused_layers=a.fused_layers,
        scheduler_steps=a.steps,
    )
    for budget in (0, 1, 3, 7, 15):
        eng.warm_up(LiveParams(budget=budget, topk=4))
    rows: dict[str, dict] = {}
    for b in batches:
        for name in a.schedules.split(","):
            schedule = SCHEDULES[name]
            t0 = time.perf_counter()
            row = run(eng, prompts, schedule, a.max_tokens, b)
            row["s"] = round(time.perf_counter() - t0, 1)
            rows[f"{name}@B{b}"] = row
            print(f"{name}@B{b}", row, flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    res = {
        "machine": machine,
        "engine": {
            "attention": eng.target.attention,
            "fused_layers": eng.fused_layers,
            "graphs": eng.target.graphs.enabled,
            "device_tree": eng.device_tree,
            "steps": a.steps,
        },
        "command": " ".join(sys.argv),
        "rows": rows,
    }
    (Path(a.out) / f"{a.name}.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
