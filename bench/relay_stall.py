"""How long a replica's event loop is held while it applies its extra API processes'
metrics (ddserve.serve.metrics_relay.MetricsRelay), with Ray's real metrics (a local Ray).

    python -m ddserve.bench.relay_stall [--observations 3000] [--slices 1000000,128]

A ticker task on the loop records the longest gap between its turns while one batch of
inter-token latencies (a relay period's worth at C=64 on the H200: ~16.7k tok/s x 3/4 of the
streams on the extra processes x RELAY_S) is applied, all at once (a huge slice: what the
first version did) and a slice at a time. Prints and returns the gaps (ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time


async def _one(relay, batch, settle_s: float = 0.05) -> float:
    gaps = [0.0]
    stop = False

    async def ticker():
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = asyncio.ensure_future(ticker())
    await asyncio.sleep(settle_s)
    gaps[:] = [0.0]
    relay.apply(batch)
    while relay._work or relay._draining:
        await asyncio.sleep(0)
    stop = True
    await t
    return max(gaps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--observations", type=int, default=3000)
    ap.add_argument("--slices", default="1000000,128")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    from ddserve.serve import metrics_relay
    from ddserve.serve.metrics import RayExporter
    from ddserve.serve.metrics_relay import MetricsRelay

    exporter = RayExporter("bench")
    batch = [[1, "inter_token_latency_seconds", [], [0.002] * a.observations]]
    out = {}
    for s in (int(x) for x in a.slices.split(",")):
        metrics_relay.RELAY_SLICE = s
        relay = MetricsRelay(exporter)
        worst = [asyncio.run(_one(relay, batch)) for _ in range(a.repeats)]
        out[s] = {"max_gap_ms": [round(w, 2) for w in worst]}
        print(
            f"slice {s}: longest gap of the loop {min(worst):.2f}-{max(worst):.2f} ms", flush=True
        )
    print(json.dumps(out))
    ray.shutdown()


if __name__ == "__main__":
    main()
