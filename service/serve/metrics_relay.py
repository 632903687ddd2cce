"""An extra API process's metrics on their way to its replica (ddserve.serve.api_process):
`RelayExporter` in the extra process sums and batches them onto a pipe, `MetricsRelay` in the
replica applies them to the replica's exporter (Ray's metrics) a slice at a time."""

from __future__ import annotations

import asyncio
import collections
import os

import msgpack

RELAY_S = 0.1  # how often an extra process sends its metrics to the replica
RELAY_SLICE = 128  # metric calls the replica makes for them per turn of its loop


class RelayExporter:
    """An extra process's metrics exporter (the interface of ddserve.api.prometheus's
    exporters): counters summed and observations kept, sent every RELAY_S to the replica as
    one msgpack array [[0, name, labels, total], [1, name, labels, [values]], ...] over a
    pipe. Gauges are the replica's own (its config and its engine's load: one per replica).
    A replica that does not read holds the batches here, never this process's loop."""

    def __init__(self, fd: int):
        self.fd = fd
        os.set_blocking(fd, False)
        self._counts: dict[tuple, float] = {}
        self._values: dict[tuple, list[float]] = {}
        self._pending = b""

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        self._counts[key] = self._counts.get(key, 0.0) + value

    def observe(self, name: str, value: float, **labels: str) -> None:
        self._values.setdefault((name, tuple(sorted(labels.items()))), []).append(value)

    def set(self, name: str, value: float, **labels: str) -> None:
        pass

    def refresh(self) -> None:
        pass

    def flush(self) -> None:
        batch = [[0, n, labels, v] for (n, labels), v in self._counts.items()]
        batch += [[1, n, labels, v] for (n, labels), v in self._values.items()]
        self._counts, self._values = {}, {}
        if batch:
            self._pending += msgpack.packb(batch)
        if self._pending:
            try:
                sent = os.write(self.fd, self._pending)
            except BlockingIOError:
                return
            except OSError:  # the replica is gone: nobody to count them
                self._pending = b""
                return
            self._pending = self._pending[sent:]

    async def run(self) -> None:
        while True:
            await asyncio.sleep(RELAY_S)
            self.flush()


class MetricsRelay:
    """The replica's side: applies every extra process's batches to its exporter, a slice at
    a time (RELAY_SLICE metric calls, then the loop's other callbacks: a Ray metric call
    costs a few microseconds, and four processes' quarter-second of tokens at once held this
    loop, whose own streams then waited, for ~10 ms)."""

    def __init__(self, exporter):
        self.exporter = exporter
        self._fds: list[int] = []
        self._work: collections.deque = collections.deque()
        self._draining = False

    def attach(self, fd: int) -> None:
        os.set_blocking(fd, False)
        unpacker = msgpack.Unpacker(raw=False)
        asyncio.get_running_loop().add_reader(fd, self._read, fd, unpacker)
        self._fds.append(fd)

    def _read(self, fd: int, unpacker) -> None:
        try:
            data = os.read(fd, 1 << 20)
        except BlockingIOError:
            return
        if not data:  # that process is gone
            self._drop(fd)
            return
        unpacker.feed(data)
        for batch in unpacker:
            self.apply(batch)

    def apply(self, batch: list) -> None:
        """Queue a batch; it is applied over the next turns of the loop."""
        for kind, name, labels, value in batch:
            self._work.append((kind, name, dict(labels), value))
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        ex, budget = self.exporter, RELAY_SLICE
        while self._work and budget > 0:
            kind, name, tags, value = self._work[0]
            if kind == 0:
                ex.inc(name, value, **tags)
                self._work.popleft()
                budget -= 1
                continue
            n = min(budget, len(value))
            for v in value[:n]:
                ex.observe(name, v, **tags)
            budget -= n
            if n == len(value):
                self._work.popleft()
            else:
                self._work[0] = (kind, name, tags, value[n:])
        if self._work:
            asyncio.get_running_loop().call_soon(self._drain)
        else:
            self._draining = False

    def _drop(self, fd: int) -> None:
        asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)
        self._fds.remove(fd)

    def close(self) -> None:
        for fd in list(self._fds):
            self._drop(fd)
