"""The engine's per-round sampling cost, batched against per request, on the GPU.

    python -m ddserve.bench.sampling_batch [--requests 1,16,64] [--width 1] [--vocab 49152]

For R sampled requests of W rows each (SmolLM2's vocabulary, random logits, T=0.8, top-p
0.95, and T=1 plain), behind ~4 ms of GPU work standing in for the verify: wall time until
every request's tokens are on the host, the way the engine did it (the verify's copy, then
per request a filter, a multinomial with its generator and a copy: `target_tokens`) and the
way it does now (one batched draw queued behind the verify, read back in the same copy:
`sample_rows`). Median of 50 rounds after 5 warm-ups. Writes
NAME.json under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ddserve.engine.sampling import (
    SampleGroup,
    SamplingParams,
    sample_inputs,
    sample_rows,
    target_tokens,
)


def per_request(logits, groups, verify) -> list[list[int]]:
    """The engine before: the verify, its one copy, then per request a draw and a copy."""
    verify()
    logits.argmax(-1).cpu()
    return [
        target_tokens(logits[g.row : g.row + g.n], g.params, g.generator).tolist() for g in groups
    ]


def batched(logits, groups, verify) -> list[int]:
    """The engine now: the draws queued behind the verify, in the one copy (inputs staged)."""
    inputs = (
        torch.from_numpy(sample_inputs(groups)).pin_memory().to(logits.device, non_blocking=True)
    )
    verify()
    _, tokens, ok = sample_rows(logits, groups, inputs)
    return torch.stack([logits.argmax(-1), tokens, ok.long()]).cpu().tolist()


def timed(fn, logits, groups, verify, reps: int = 50) -> float:
    for _ in range(5):
        fn(logits, groups, verify)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(logits, groups, verify)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", default="1,16,64")
    ap.add_argument("--width", type=int, default=1, help="rows per request (tree nodes + 1)")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--name", default="sampling_batch")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ddserve.bench.sampling_batch times GPU sampling: it needs a GPU")
    result = {"device": torch.cuda.get_device_name(), "width": a.width, "rows": []}
    for label, sp in (
        ("T=0.8 top_p=0.95", SamplingParams(temperature=0.8, top_p=0.95)),
        ("T=1", SamplingParams(temperature=1.0)),
    ):
        for r in (int(x) for x in a.requests.split(",")):
            logits = torch.randn(r * a.width, a.vocab, device="cuda") * 3
            groups = [
                SampleGroup(
                    i * a.width, a.width, sp, None, torch.Generator(device="cuda").manual_seed(i)
                )
                for i in range(r)
            ]
            ma, mb = torch.randn(2, 2048, 2048, device="cuda")
            verify = lambda ma=ma, mb=mb: [ma @ mb for _ in range(12)]  # noqa: E731 - ~4 ms
            old = timed(per_request, logits, groups, verify)
            new = timed(batched, logits, groups, verify)
            row = {"params": label, "requests": r, "per_request_ms": round(old, 3)}
            row |= {"batched_ms": round(new, 3), "speedup": round(old / new, 2)}
            result["rows"].append(row)
            print(
                f"{label:18s} R={r:3d}: per request {old:7.3f} ms  batched {new:7.3f} ms  "
                f"({old / new:.1f}x)",
                flush=True,
            )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
