"""A Ray replica's API processes (`api_server_count` in a deploy YAML; vLLM's
`--api-server-count`, here per replica).

A replica is one process: with Ray's HAProxy ingress it serves HTTP itself (Serve's "direct
ingress"), and at high concurrency its one event loop, not the engine, set the pace (issue
13: every token of every stream is an HTTP write; the engine server's first token at 64
streams came 4 ms after the in-process runner's with four API processes, 28-41 ms with one).
So a replica of the builtin engine may run `api_server_count - 1` more API processes, as the
engine server does (ddserve.backends.api_processes): each joins the replica's engine core as
one more client (ddserve.backends.core.CoreBackend.attach) and accepts connections on the
replica's own listening socket, inherited once Serve has opened it, so HAProxy's
connections to this replica spread over all of them. Every process serves the same app
(`replica_app`); the extra ones also answer Serve's `/-/healthz` and `/-/routes` (HAProxy
health-checks the replica's port) and send their metrics to the replica, which exports
them through Ray with its own (ddserve.serve.metrics_relay). They die with the
replica; one that dies takes the replica down (Serve replaces it), as a dead engine does.

Only the replica's own process is seen by Serve: its ongoing-request count and access log
count what reaches that process. Autoscaling counts the engine's requests instead, every
process's (ddserve.serve.autoscaling).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time

from ddserve.api.app import create_app, freeze_startup_heap
from ddserve.api.observability import MeteredBackend, drafter_depth
from ddserve.backends.api_processes import (
    STOP_S,
    Deaths,
    Extras,
    run_extra,
    say_ready,
)
from ddserve.backends.core import CoreBackend
from ddserve.config.deploy import ServeConfig
from ddserve.serve.metrics_relay import MetricsRelay, RelayExporter

log = logging.getLogger(__name__)

MODULE = "ddserve.serve.api_process"  # what an extra process runs (its `main`)
SOCKET_WAIT_S = 300.0  # how long a replica looks for the listening socket Serve opens
# how long a stopping replica waits for its extra processes' streams (Serve's grace is 120 s:
# ddserve.serve.replica.deployment_options)
DRAIN_S = 100.0
# idle connections kept as long as Serve's own replica server keeps them (HAProxy reuses
# them: `http-reuse always`); Ray's default, or its variable
KEEP_ALIVE_S = int(os.environ.get("RAY_SERVE_HTTP_KEEP_ALIVE_TIMEOUT_S") or 90)


class ResponseHeader:
    """Pure ASGI middleware adding one header to every HTTP response. (FastAPI's
    `@app.middleware("http")` runs each response through a task and a memory stream: with
    128-token streams it doubled the app's CPU per request, ~47 us per chunk.)"""

    def __init__(self, app, name: str, value: str):
        self.app = app
        self.header = (name.lower().encode("latin-1"), value.encode("latin-1"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, tagged)


def replica_app(backend, cfg: ServeConfig, replica_id: str, api_server: tuple[int, int] = (0, 1)):
    """The app every API process of a replica serves (its answers say the replica)."""
    app = create_app(
        backend,
        admin_token=cfg.admin_token,
        title="ddserve",
        admin_enabled=False,
        api_key=cfg.api_key,
        stream_interval=cfg.engine.stream_interval,
        api_server=api_server,
    )
    app.add_middleware(ResponseHeader, name="x-ddserve-replica", value=replica_id)
    return app


class ServeRoutes:
    """What Serve's replica server answers besides the app, for an extra process on the
    same port: HAProxy's health check `/-/healthz` and `/-/routes`. Healthy while the engine
    core lives and the replica says nothing else: 503 once its own health check failed
    (`unhealthy`) or it drains (`draining`), as Serve's own answer there."""

    def __init__(self, app, backend, routes: dict):
        self.app, self.backend = app, backend
        self.routes = json.dumps(routes).encode()
        self.unhealthy = False
        self.draining = False

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path == "/-/healthz":
            if self.draining:
                return await _answer(send, 503, b"DRAINING", b"text/plain")
            if self.unhealthy or not self.backend.alive():
                return await _answer(send, 503, b"UNHEALTHY", b"text/plain")
            return await _answer(send, 200, b"success", b"text/plain")
        if path == "/-/routes":
            return await _answer(send, 200, self.routes, b"application/json")
        return await self.app(scope, receive, send)


async def _answer(send, status: int, body: bytes, content_type: bytes) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# -- the replica's side ----------------------------------------------------------------------
def listening_socket(ports: range) -> tuple[int, str] | None:
    """(descriptor, inode) of this process's one listening TCP socket on a port in `ports`
    (Serve's replica server: it binds one port of its direct-ingress range, and Serve's API
    says neither the port nor the socket); None while there is none, or more than one."""
    wanted: set[str] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) in ports:  # 0A: LISTEN
                wanted.add(f[9])  # its inode
    found = [(fd, inode) for fd, inode in _socket_fds() if inode in wanted]
    return found[0] if len(found) == 1 else None


def _socket_fds() -> list[tuple[int, str]]:
    """(descriptor, inode) of every socket this process holds."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.append((int(name), link[8:-1]))
    return out


class ReplicaApiProcesses:
    """A replica's extra API processes: started (and ready: joined the core, the app built)
    during the replica's start-up, handed Serve's listening socket once it is open, told the
    replica's health, drained when Serve stops accepting, stopped.

    The socketpair that carries the socket then carries one byte at a time: b"U" / b"H"
    (the replica's health check failed / passed again), b"D" (drain: stop accepting, finish
    the streams); its end, too, drains them."""

    def __init__(self, cfg: ServeConfig, replica_id: str, backend: CoreBackend, exporter):
        self.cfg, self.replica_id, self.backend = cfg, replica_id, backend
        self.count = cfg.api_server_count
        self.relay = MetricsRelay(exporter)
        self.extras: Extras | None = None
        self._channels: list[socket.socket] = []  # this side of each one's socketpair
        self._healthy = True
        self._draining = False  # told to drain: their exits are expected now
        self._watch: asyncio.Task | None = None
        self.note = ""  # why they do not serve, when they do not

    async def start(self) -> None:
        """Start them and wait until each is ready to serve (a failure raises)."""
        pipes = [os.pipe() for _ in range(1, self.count)]
        pairs = [socket.socketpair() for _ in range(1, self.count)]
        payloads = [
            {
                "config": self.cfg.model_dump(mode="json"),
                "replica_id": self.replica_id,
                "core_pid": self.backend.process.pid,
                "core_url": self.backend.url,
                "metrics_fd": w,
                "channel_fd": theirs.fileno(),
                "pass_fds": [w, theirs.fileno()],
                "keep_alive_s": KEEP_ALIVE_S,
                "routes": {"/": self.cfg.name},
            }
            for i, ((_, w), (_, theirs)) in enumerate(zip(pipes, pairs, strict=True), 1)
        ]
        self.extras = Extras(MODULE, payloads, None)
        self._channels = [ours for ours, _ in pairs]
        try:
            self.extras.start()
        except BaseException:
            for r, _ in pipes:
                os.close(r)
            raise
        finally:
            for (_, w), (_, theirs) in zip(pipes, pairs, strict=True):
                os.close(w)
                theirs.close()
        for r, _ in pipes:
            self.relay.attach(r)
        await asyncio.to_thread(self.extras.wait_ready)

    async def listen(self, ports: range) -> bool:
        """Once Serve listens on this replica's port (after __init__ and the first
        reconfigure), hand each extra process the socket, and drain them once Serve closes
        its own (its graceful shutdown: the port must refuse new connections, so HAProxy
        tries another replica). False (`note` says why, and they are stopped) when Serve
        opens none here within SOCKET_WAIT_S."""
        deadline = time.monotonic() + SOCKET_WAIT_S
        found = listening_socket(ports)
        while found is None:
            if time.monotonic() > deadline:
                self.note = (
                    f"no single listening socket of Serve's direct ingress (ports "
                    f"{ports.start}-{ports.stop - 1}) in {SOCKET_WAIT_S:.0f}s: this replica "
                    "serves with one API process (api_server_count needs Ray's HAProxy ingress)"
                )
                await asyncio.to_thread(self.stop)
                return False
            await asyncio.sleep(0.05)
            found = listening_socket(ports)
        fd, inode = found
        for i, channel in enumerate(self._channels, 1):
            try:
                socket.send_fds(channel, [b"L"], [fd])
            except OSError as exc:  # that one is gone: the watchdog takes the replica down
                log.error("API process %d: the socket could not be handed over: %s", i, exc)
        self._watch = asyncio.get_running_loop().create_task(self._drain_with_serve(inode))
        return True

    async def _drain_with_serve(self, inode: str) -> None:
        while any(i == inode for _, i in _socket_fds()):
            await asyncio.sleep(0.25)
        log.info("Serve stopped accepting on this replica: draining its API processes")
        self._draining = True
        self._tell(b"D")

    def set_healthy(self, ok: bool) -> None:
        """The replica's health check's verdict, for the extra processes' `/-/healthz`."""
        if ok != self._healthy:
            self._healthy = ok
            self._tell(b"H" if ok else b"U")

    def _tell(self, state: bytes) -> None:
        for channel in self._channels:
            try:
                channel.send(state, socket.MSG_DONTWAIT)
            except OSError:
                pass

    def dead(self) -> str | None:
        """Why one of them is gone, while none should be."""
        return self.extras.dead() if self.extras and not self._draining else None

    def stop(self, grace_s: float = STOP_S) -> None:
        """Graceful: no new connections, their streams finish (before the engine stops),
        within `grace_s`. (Called in a thread: the drain watch is left to end with the
        replica; with no channel left it tells no one.)"""
        for channel in self._channels:  # each drains (one still waiting for the socket exits)
            channel.close()
        self._channels = []
        extras, self.extras = self.extras, None
        if extras is not None:
            extras.stop(grace_s)


def _listener(channel: socket.socket) -> socket.socket | None:
    """The listening socket the replica hands over, or None when it closed the channel."""
    _, fds, _, _ = socket.recv_fds(channel, 1, 1)
    return socket.socket(fileno=fds[0]) if fds else None


def _follow(channel: socket.socket, routes: ServeRoutes, server) -> None:
    """Apply the replica's word on the channel (ReplicaApiProcesses): health, or drain (its
    end closed drains too)."""
    channel.setblocking(False)
    loop = asyncio.get_running_loop()

    def read() -> None:
        try:
            data = channel.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        for state in data:
            if state == ord("U"):
                routes.unhealthy = True
            elif state == ord("H"):
                routes.unhealthy = False
            elif state == ord("D"):
                routes.draining = server.should_exit = True
        if not data:
            loop.remove_reader(channel.fileno())
            routes.draining = server.should_exit = True

    loop.add_reader(channel.fileno(), read)


# -- an extra process --------------------------------------------------------------------------
async def serve_extra(payload: dict) -> int:
    """Join the replica's core, say ready, serve until told to stop (0) or until the core
    dies (1)."""
    import uvicorn

    from ddserve.engine.weights import load_tokenizer

    cfg = ServeConfig.model_validate(payload["config"])
    index, count = payload["index"], payload["count"]
    channel = socket.socket(fileno=payload["channel_fd"])
    died = Deaths()
    tokenizer = await asyncio.to_thread(load_tokenizer, cfg.engine.model)
    backend = await CoreBackend.attach(
        cfg.engine,
        tokenizer,
        pid=payload["core_pid"],
        url=payload["core_url"],
        client=index,
        clients=count,
        on_death=died,
    )
    exporter = RelayExporter(payload["metrics_fd"])
    relay = asyncio.ensure_future(exporter.run())
    try:
        metered = MeteredBackend(
            backend, exporter, drafter_depth=drafter_depth(cfg.engine.drafter.model_dump())
        )
        app = replica_app(metered, cfg, payload["replica_id"], (index, count))
        routes = ServeRoutes(app, backend, payload["routes"])
        server = died.server = uvicorn.Server(
            uvicorn.Config(
                routes,
                timeout_keep_alive=payload["keep_alive_s"],
                access_log=False,
                log_level="warning",
            )
        )
        say_ready(payload)
        sock = await asyncio.to_thread(_listener, channel)
        if sock is not None and not died:
            _follow(channel, routes, server)
            freeze_startup_heap()
            await server.serve(sockets=[sock])
    finally:
        relay.cancel()
        exporter.flush()
        await backend.aclose()
    return 1 if died else 0


def main() -> int:
    return run_extra(serve_extra, log)
