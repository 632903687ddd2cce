"""The engine server's API processes (`ddserve engine`): HTTP, JSON and detokenisation over
one engine core process (ddserve.engine.core), which runs the scheduler.

`--api-server-count N` (vLLM's flag; default 1) runs N of them on one listening socket, as
vLLM's API servers share one EngineCore: the first in `ddserve engine`'s own process, which
starts the core and owns everything, and N-1 more, each running `main` below (told what to
serve by env DDSERVE_API_SERVER, the socket inherited as a file descriptor),
joining the core as its client i (ddserve.backends.core.CoreBackend.attach). The kernel hands
each new connection to whichever process accepts first. What is shared and what is not:

- live parameters: one change through any process is in force in all before it answers;
- /metrics: summed over the processes (prometheus_client's multiprocess mode, in a
  directory of the server's own);
- `--max-requests`: each process admits its share (ceil(max / N));
- /server_info's totals and the stats line: the answering process's own (it says which);
- a process that dies takes the server down (non-zero exit: the supervisor restarts it),
  as does the core; the extra processes die with the first.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import socket
import tempfile
from dataclasses import asdict, dataclass, field, replace

from ddserve.api.limits import ServerLimits
from ddserve.backends.api_processes import (
    Deaths,
    Extras,
    label_logs,
    run_extra,
    say_ready,
)
from ddserve.config.engine import EngineConfig

log = logging.getLogger("ddserve.api_server")

MODULE = "ddserve.cli.api_server"  # what an extra process runs (its `main`)


@dataclass
class ApiServer:
    """What every API process of one server serves with."""

    host: str
    port: int
    log_level: str = "info"
    access_log: bool | None = None
    stats_interval_s: float | None = None
    admin_token: str | None = None
    api_key: str | None = None
    limits: dict = field(default_factory=lambda: asdict(ServerLimits()))
    count: int = 1
    index: int = 0  # which process this is: 0 owns the core

    def server_limits(self) -> ServerLimits:
        """This process's share of the limits (`max_requests` is per server)."""
        lim = ServerLimits(**self.limits)
        if lim.max_requests and self.count > 1:
            lim = replace(lim, max_requests=math.ceil(lim.max_requests / self.count))
        return lim


def build_server(spec: ApiServer, config: EngineConfig, backend):
    """The app over `backend` (a CoreBackend) and the uvicorn server that will serve it."""
    import uvicorn

    from ddserve.api.app import create_app

    app = create_app(
        backend,
        admin_token=spec.admin_token,
        limits=spec.server_limits(),
        api_key=spec.api_key,
        access_log=spec.access_log,  # None: env DDSERVE_ACCESS_LOG
        stats_interval_s=spec.stats_interval_s,  # None: env DDSERVE_STATS_INTERVAL, else 10
        stream_interval=config.stream_interval,
        api_server=(spec.index, spec.count),
    )
    return uvicorn.Server(
        uvicorn.Config(
            app, host=spec.host, port=spec.port, log_level=spec.log_level, access_log=False
        )
    )


async def serve_first(spec: ApiServer, config: EngineConfig, sock: socket.socket) -> int:
    """`ddserve engine`'s own process: start the engine core (this process is its client 0),
    the extra API processes once it is ready, then serve HTTP. Returns non-zero when the
    core or an extra process died under it (a supervisor restarts the whole server)."""
    from ddserve.api.app import freeze_startup_heap
    from ddserve.api.prometheus import MULTIPROC_ENV
    from ddserve.backends.core import CoreBackend
    from ddserve.engine.weights import load_tokenizer

    died = Deaths()
    metrics_dir = None
    if spec.count > 1:  # every process's metrics, summed at /metrics
        label_logs(0, spec.count)
        metrics_dir = tempfile.mkdtemp(prefix="ddserve-metrics-")
        os.environ[MULTIPROC_ENV] = metrics_dir
    extras: Extras | None = None
    backend = None
    try:
        # the tokenizer loads here while the core loads the weights; the core's verdict on
        # the model comes first (one message for a model that cannot be loaded, whatever the
        # part)
        tokenizer = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, config.model))
        try:
            backend = await CoreBackend.start(
                config, None, timeout=3600, on_death=died, clients=spec.count
            )
        except BaseException:
            tokenizer.cancel()
            await asyncio.gather(tokenizer, return_exceptions=True)
            raise
        backend.tokenizer = await tokenizer
        if spec.count > 1:
            extras = Extras(
                MODULE,
                [
                    {
                        "server": asdict(spec) | {"index": i},
                        "log_level": spec.log_level,
                        "config": config.model_dump(mode="json"),
                        "core_pid": backend.process.pid,
                        "core_url": backend.url,
                    }
                    for i in range(1, spec.count)
                ],
                sock.fileno(),
            )
            extras.start()
            await asyncio.to_thread(extras.wait_ready)
        server = died.server = build_server(spec, config, backend)
        print(
            f"ddserve engine: {config.model_id} on http://{spec.host}:{spec.port} (fingerprint {backend.fingerprint}, engine core pid {backend.process.pid}"
            + (f", {spec.count} API processes" if spec.count > 1 else "")
            + (", API key required" if spec.api_key else "")
            + ")",
            flush=True,
        )
        watch = asyncio.ensure_future(_supervise(server, extras, died)) if extras else None
        try:
            if not died:
                freeze_startup_heap()
                await server.serve(sockets=[sock])
        finally:
            if watch is not None:
                watch.cancel()
    finally:
        if extras is not None:
            await asyncio.to_thread(extras.stop)
        if backend is not None:
            await backend.aclose()
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 1 if died else 0


async def _supervise(server, extras: Extras, on_death) -> None:
    """An extra process that exits stops the server; a server that stops (a signal, the core
    gone, a process gone) stops the extra processes at once: they share the port, so until
    they stop too new connections would still be accepted, and cut off when the core goes."""
    while True:
        await asyncio.sleep(0.05)
        if server.should_exit:
            extras.terminate()
            return
        msg = extras.dead()
        if msg is not None:
            log.error("%s; stopping the server", msg)
            on_death(msg)


async def serve_extra(payload: dict) -> int:
    """One extra API process: join the core, say ready, serve until told to stop (0) or
    until the core dies (1)."""
    from ddserve.api.app import freeze_startup_heap
    from ddserve.backends.core import CoreBackend
    from ddserve.engine.weights import load_tokenizer

    spec = ApiServer(**payload["server"])
    config = EngineConfig.model_validate(payload["config"])
    sock = socket.socket(fileno=payload["fd"])
    died = Deaths()
    tokenizer = await asyncio.to_thread(load_tokenizer, config.model)
    backend = await CoreBackend.attach(
        config,
        tokenizer,
        pid=payload["core_pid"],
        url=payload["core_url"],
        client=spec.index,
        clients=spec.count,
        on_death=died,
    )
    try:
        server = died.server = build_server(spec, config, backend)
        say_ready(payload)
        if not died:
            freeze_startup_heap()
            await server.serve(sockets=[sock])
    finally:
        await backend.aclose()
    return 1 if died else 0


def main() -> int:
    return run_extra(serve_extra, log)
