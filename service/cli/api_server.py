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
import json
import logging
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace

from ddserve.api.limits import ServerLimits
from ddserve.backends.process import die_with_parent
from ddserve.config.engine import EngineConfig
from ddserve.errors import EngineUnavailable

log = logging.getLogger("ddserve.api_server")

SPEC_ENV = "DDSERVE_API_SERVER"  # an extra process's ApiServer, as JSON (secrets: never argv)
READY_S = 600.0  # an extra process loads a tokenizer and joins the core: minutes at most
STOP_S = 20.0
# an extra process's entry (`-m ddserve.cli.api_server` would run this module a second time:
# the package imports it first)
ENTRY = "import sys; from ddserve.cli.api_server import main; sys.exit(main())"


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


class Deaths:
    """What died under a server (the core: its backend's `on_death`; an extra process: the
    supervisor): each stops the server; any makes its exit code non-zero."""

    def __init__(self):
        self.messages: list[str] = []
        self.server = None  # the uvicorn server, once there is one

    def __call__(self, message: str) -> None:
        self.messages.append(message)
        if self.server is not None:
            self.server.should_exit = True

    def __bool__(self) -> bool:
        return bool(self.messages)


class Extras:
    """The N-1 extra API processes of a server: started, waited for, watched, stopped."""

    def __init__(
        self,
        spec: ApiServer,
        config: EngineConfig,
        sock: socket.socket,
        core_pid: int,
        core_url: str,
    ):
        self.spec, self.config, self.sock = spec, config, sock
        self.core_pid, self.core_url = core_pid, core_url
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        fd = self.sock.fileno()
        self._ready: list[int] = []
        for i in range(1, self.spec.count):
            r, w = os.pipe()
            payload = {
                "server": asdict(self.spec) | {"index": i},
                "config": self.config.model_dump(mode="json"),
                "core_pid": self.core_pid,
                "core_url": self.core_url,
                "fd": fd,
                "ready_fd": w,
            }
            env = {**os.environ, SPEC_ENV: json.dumps(payload)}
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-c", ENTRY],
                    env=env,
                    pass_fds=(fd, w),
                    preexec_fn=die_with_parent,
                )
            finally:
                os.close(w)
            self.procs.append(proc)
            self._ready.append(r)

    def wait_ready(self, timeout: float = READY_S) -> None:
        """Until every extra process says it serves; one that exits first fails the start."""
        deadline = time.monotonic() + timeout
        try:
            for i, (proc, r) in enumerate(zip(self.procs, self._ready, strict=True), 1):
                left = deadline - time.monotonic()
                if not select.select([r], [], [], max(left, 0))[0]:
                    raise EngineUnavailable(f"API process {i} not ready within {timeout:.0f}s")
                if not os.read(r, 1):
                    proc.wait(10)
                    raise EngineUnavailable(
                        f"API process {i} exited with code {proc.returncode} before it was ready (see the log above)"
                    )
        finally:
            for r in self._ready:
                os.close(r)
            self._ready = []

    def dead(self) -> str | None:
        for i, proc in enumerate(self.procs, 1):
            if proc.poll() is not None:
                return f"API process {i} (pid {proc.pid}) exited with code {proc.returncode}"
        return None

    def terminate(self) -> None:
        """Ask each to stop (uvicorn's graceful stop: no new connections, streams finish)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float = STOP_S) -> None:
        self.terminate()
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def label_logs(index: int, count: int) -> None:
    """Every log line of this process says which API process it is (`[api 1/4]`)."""
    fmt = logging.Formatter(
        f"%(asctime)s %(levelname)s %(name)s [api {index}/{count}]: %(message)s"
    )
    for handler in logging.getLogger().handlers:
        handler.setFormatter(fmt)


def stop_on_signals() -> None:
    """SIGTERM and SIGINT end this process through its clean-up (SystemExit(0)) wherever
    uvicorn's own handlers are not in place: while it starts, and when uvicorn raises the
    signal again after its graceful stop (the default action killed the process there,
    before the clean-up: the core left to its death signal, temporary directories left
    behind; and asyncio's SIGINT handler could lose a signal that came between start-up and
    serving)."""

    def stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def event_loop_factory():
    """uvloop's event loop where it is installed (uvicorn[standard] brings it; vLLM's and
    SGLang's API servers run on it too, and Ray's workers install it), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def serve_first(spec: ApiServer, config: EngineConfig, sock: socket.socket) -> int:
    """`ddserve engine`'s own process: start the engine core (this process is its client 0),
    the extra API processes once it is ready, then serve HTTP. Returns non-zero when the
    core or an extra process died under it (a supervisor restarts the whole server)."""
    from ddserve.api.app import freeze_startup_heap
    from ddserve.api.observability import MULTIPROC_ENV
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
            extras = Extras(spec, config, sock, backend.process.pid, backend.url)
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
        os.write(payload["ready_fd"], b"1")
        os.close(payload["ready_fd"])
        if not died:
            freeze_startup_heap()
            await server.serve(sockets=[sock])
    finally:
        await backend.aclose()
    return 1 if died else 0


def main() -> int:
    stop_on_signals()
    payload = json.loads(os.environ.pop(SPEC_ENV))
    server = payload["server"]
    logging.basicConfig(level=server["log_level"].upper())
    label_logs(server["index"], server["count"])
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(serve_extra(payload))
    except KeyboardInterrupt:
        return 0
    except Exception as exc:
        log.error("API process %d failed: %s", server["index"], exc, exc_info=exc)
        return 1
