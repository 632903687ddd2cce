"""Whether a CUDA green context (torch.cuda.green_contexts) keeps a decode step fast beside a
prompt chunk (issue 18: on the H100 the step took 1.95 ms alone and 3.85 ms beside an
overlapped chunk, whose kernels hold the multiprocessors; stream priority does not preempt a
running block). Synthetic and model-shaped, no engine: a "step" is 30 layers of SmolLM2-135M's
GEMMs (qkv, o, gate/up, down, a norm) over 16 rows, a "chunk" the same over --rows rows, each a
CUDA graph. Times by CUDA events, median of --reps: each alone; both launched together on two
streams (the step's of high priority, as the engine's); and with the chunk confined to a green
context of N multiprocessors (the step keeps the whole device, so some SMs are always free
for it), for each N of --sms.

    python -m ddserve.bench.green_probe [--rows 1024] [--sms 33,66,99] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

H, QKV, INTER, LAYERS = 576, 960, 1536, 30


def model_fn(rows: int, dtype):
    """A forward-shaped function over `rows` rows (its inputs and weights made here)."""
    dev = torch.device("cuda")
    x = torch.randn(rows, H, device=dev, dtype=dtype)
    ws = [
        tuple(
            torch.randn(a, b, device=dev, dtype=dtype) * 0.02
            for a, b in ((H, QKV), (H, H), (H, 2 * INTER), (INTER, H))
        )
        for _ in range(LAYERS)
    ]

    def fn():
        y = x
        for wq, wo, wgu, wd in ws:
            y = y * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(dtype)
            y = y + (y @ wq)[:, :H] @ wo
            g, u = (y @ wgu).chunk(2, dim=-1)
            y = y + (torch.nn.functional.silu(g) * u) @ wd
        return y

    return fn


def capture(fn, stream):
    """fn's CUDA graph, warmed up and captured on `stream`."""
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    stream.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    torch.cuda.synchronize()
    return g


def run(pairs, reps: int) -> list[float]:
    """Replay each (graph, stream) of `pairs` together, `reps` times: the median GPU ms of each
    (its own stream's events), then the wall ms of the whole (first start to last end)."""
    per = [[] for _ in pairs]
    walls = []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        evs = []
        for g, s in pairs:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                a.record()
                g.replay()
                b.record()
            evs.append((a, b))
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(evs):
            per[i].append(a.elapsed_time(b))
        walls.append(max(evs[0][0].elapsed_time(b) for _, b in evs))
    return [round(statistics.median(p[2:]), 3) for p in [*per, walls]]


def green_stream(num_sms: int):
    """A stream of a green context of `num_sms` multiprocessors, and the context."""
    from torch.cuda.green_contexts import GreenContext

    gc = GreenContext.create(num_sms=num_sms, device_id=torch.cuda.current_device())
    if hasattr(gc, "Stream"):
        return gc.Stream(), gc
    gc.set_context()  # older torch: the green context's stream becomes current
    try:
        return torch.cuda.current_stream(), gc
    finally:
        gc.pop_context()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--step-rows", type=int, default=16)
    ap.add_argument("--sms", default="")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    a = ap.parse_args()
    total = torch.cuda.get_device_properties(0).multi_processor_count
    sms = [int(s) for s in a.sms.split(",") if s] or [total // 4, total // 2, 3 * total // 4]
    out = {"device": torch.cuda.get_device_name(0), "sms": total, "torch": torch.__version__}
    out["green_supported"] = bool(getattr(torch.cuda.green_contexts, "SUPPORTED", False))
    hi = torch.cuda.Stream(priority=-1)
    lo = torch.cuda.Stream()
    step_fn, chunk_fn = model_fn(a.step_rows, torch.bfloat16), model_fn(a.rows, torch.bfloat16)
    step, chunk = capture(step_fn, hi), capture(chunk_fn, lo)
    out["step_alone_ms"] = run([(step, hi)], a.reps)[0]
    out["chunk_alone_ms"] = run([(chunk, lo)], a.reps)[0]
    c, s, wall = run([(chunk, lo), (step, hi)], a.reps)
    out["beside"] = {"chunk_ms": c, "step_ms": s, "wall_ms": wall}
    out["green"], keep = {}, []
    for n in sms:
        try:
            gs, gc = green_stream(n)
            try:  # a graph captured in the green context's own stream
                gchunk = capture(chunk_fn, gs)
            except Exception as exc:  # noqa: BLE001 - report which way works
                out["green"][n] = {"capture_error": repr(exc)[:200]}
                gchunk = chunk
            alone = run([(gchunk, gs)], a.reps)[0]
            c, s, wall = run([(gchunk, gs), (step, hi)], a.reps)
            out["green"][n] = {
                **out["green"].get(n, {}),
                "chunk_alone_ms": alone,
                "chunk_ms": c,
                "step_ms": s,
                "wall_ms": wall,
            }
            keep.append((gc, gs, gchunk))  # alive until the end
        except Exception as exc:  # noqa: BLE001 - a probe: say what failed
            out["green"][n] = {"error": repr(exc)[:300]}
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
