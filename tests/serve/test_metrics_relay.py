"""An extra API process's metrics on their way to its replica (ddserve.serve.metrics_relay):
RelayExporter over a real pipe into MetricsRelay, with a recording exporter in place of
Ray's (the Ray path itself: tests/serve/test_api_processes_ray.py)."""

import asyncio
import os

from ddserve.serve import metrics_relay
from ddserve.serve.metrics_relay import MetricsRelay, RelayExporter


class Recorder:
    def __init__(self):
        self.calls = []

    def inc(self, name, value=1.0, **labels):
        self.calls.append(("inc", name, value, labels))

    def observe(self, name, value, **labels):
        self.calls.append(("observe", name, value, labels))


def test_every_count_and_observation_arrives_and_the_loop_turns_between_slices():
    async def main():
        r, w = os.pipe()
        sender, rec = RelayExporter(w), Recorder()
        relay = MetricsRelay(rec)
        relay.attach(r)
        values = [i / 1000 for i in range(1000)]
        for v in values:
            sender.observe("inter_token_latency_seconds", v)
        sender.inc("requests", status="ok")
        sender.inc("requests", 2, status="ok")
        sender.inc("requests", status="error")
        sender.observe("accept_length", 3.0)
        sender.set("config_info", 1.0, fingerprint="x")  # gauges stay the replica's own
        sender.flush()
        ticks = []  # callbacks of the loop's own work, counted while the relay drains

        async def ticker():
            while True:
                ticks.append(len(rec.calls))
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        for _ in range(200):
            await asyncio.sleep(0)
            if len(rec.calls) == 1003:
                break
        t.cancel()
        os.close(w)
        await asyncio.sleep(0.01)  # the pipe's end is read: the relay lets go of it
        assert relay._fds == []
        return rec, ticks, values

    rec, ticks, values = asyncio.run(main())
    itl = [c[2] for c in rec.calls if c[1] == "inter_token_latency_seconds"]
    assert itl == values  # every value, in order, none twice
    assert [c for c in rec.calls if c[0] == "inc"] == [
        ("inc", "requests", 3.0, {"status": "ok"}),
        ("inc", "requests", 1.0, {"status": "error"}),
    ]
    assert ("observe", "accept_length", 3.0, {}) in rec.calls
    assert not any(c[1] == "config_info" for c in rec.calls)
    # applied a slice at a time, the loop's other work running in between
    partial = {n for n in ticks if 0 < n < 1003}
    assert len(partial) >= 1003 // metrics_relay.RELAY_SLICE - 1, sorted(partial)


def test_a_replica_that_does_not_read_never_blocks_the_sender():
    r, w = os.pipe()
    sender = RelayExporter(w)
    for _ in range(20):  # ~20 batches of 10,000 observations: more than a pipe holds
        for i in range(10_000):
            sender.observe("inter_token_latency_seconds", i * 1e-3)
        sender.flush()  # returns at once when the pipe is full; the rest waits here
    assert sender._pending
    os.close(r)
    os.close(w)
