"""Extra API processes on one listening socket over one engine core: started, waited for,
watched and stopped, and what each such process does to start and stop cleanly.

Two servers run them, each with its own entry (the module whose `main` an extra process
runs): the engine server (`ddserve engine --api-server-count N`, ddserve.cli.api_server) and a
Ray replica (`api_server_count` in a deploy YAML, ddserve.serve.api_process). The first
process owns the core (client 0); each extra one joins it as client i of N
(ddserve.backends.core.CoreBackend.attach), the socket inherited as a file descriptor, told
what to serve by a JSON payload in env DDSERVE_API_SERVER (secrets: never argv). The kernel
hands each new connection to whichever process accepts it first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

from ddserve.backends.process import die_with_parent
from ddserve.errors import EngineUnavailable

SPEC_ENV = "DDSERVE_API_SERVER"  # an extra process's payload, as JSON
READY_S = 600.0  # an extra process loads a tokenizer and joins the core: minutes at most
STOP_S = 20.0


def entry(module: str) -> str:
    """The `-c` program of an extra process running `module.main` (`-m module` would run a
    module of the package a second time: the package imports it first)."""
    return f"import sys; from {module} import main; sys.exit(main())"


class Extras:
    """The N-1 extra API processes of a server. `payloads[i]` is what process i + 1 serves;
    each also gets "index" (i + 1), "count" (N), "fd" (the listening socket, unless it is
    None: it comes later) and "ready_fd" (a pipe it writes one byte to once it serves), and
    the descriptors listed under its "pass_fds"; "log_level" (default info) is its logs'."""

    def __init__(self, module: str, payloads: list[dict], fd: int | None):
        self.module, self.payloads, self.fd = module, payloads, fd
        self.procs: list[subprocess.Popen] = []
        self._ready: list[int] = []

    def start(self) -> None:
        count = len(self.payloads) + 1
        for index, payload in enumerate(self.payloads, 1):
            r, w = os.pipe()
            payload = {**payload, "index": index, "count": count, "fd": self.fd, "ready_fd": w}
            env = {**os.environ, SPEC_ENV: json.dumps(payload)}
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-c", entry(self.module)],
                    env=env,
                    pass_fds=(
                        *([] if self.fd is None else [self.fd]),
                        w,
                        *payload.get("pass_fds", ()),
                    ),
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

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

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


def run_extra(serve: Callable[[dict], Awaitable[int]], log: logging.Logger) -> int:
    """An extra process's whole life (its entry's `main`): its payload (taken out of the
    environment: its children do not see it), logs that say which process it is, `serve`
    on uvloop where there is one; its exit code (1 when it failed)."""
    stop_on_signals()
    payload = json.loads(os.environ.pop(SPEC_ENV))
    logging.basicConfig(level=payload.get("log_level", "info").upper())
    label_logs(payload["index"], payload["count"])
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(serve(payload))
    except KeyboardInterrupt:
        return 0
    except Exception as exc:
        log.error("API process %d failed: %s", payload["index"], exc, exc_info=exc)
        return 1


def say_ready(payload: dict) -> None:
    os.write(payload["ready_fd"], b"1")
    os.close(payload["ready_fd"])


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
