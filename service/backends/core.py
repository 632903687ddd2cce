"""`CoreBackend`: the Backend protocol (ddserve.api.backend) over an engine core process
(ddserve.engine.core) and its ZeroMQ channel (ddserve.engine.ipc).

The engine server (`ddserve engine`) and the Ray replica both serve the builtin engine this
way: the scheduler runs in its own process, this side turns token ids into text
(incrementally, ddserve.api.text.Detokenizer) and SSE. Streams coalesce: a reader waiting
on its queue takes every output that arrived meanwhile in one Delta, so a client that reads
slower than the engine decodes gets bigger chunks, never a backlog, and no timer delays a
token.

An engine core that exits fails every request in flight with EngineUnavailable within
`WATCH_S`, and calls `on_death` (the engine server exits; a replica dies and Serve replaces
it).

`CoreBackend.start` starts a core and owns it; `CoreBackend.attach` joins one another process
started (the engine server's other API processes, `--api-server-count`): client i of N,
watching the core through a pidfd.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import zmq
import zmq.asyncio

from ddserve.api.generation import Delta, TextStream
from ddserve.backends.core_process import CoreProcess, CoreRef
from ddserve.config.engine import EngineConfig, LiveParams
from ddserve.engine import ipc
from ddserve.engine.requests import health_generation
from ddserve.engine.sampling import Logprobs, RequestStats, SamplingParams
from ddserve.errors import EngineUnavailable, error_from_body

log = logging.getLogger(__name__)

WATCH_S = 0.1  # how often the core process is checked for life


class _Stream:
    """One request's view: its queue of entries, and statistics counted on this side (the
    engine's own arrive with the finish)."""

    __slots__ = ("queue", "stats")

    def __init__(self, prompt_len: int):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stats = RequestStats(prompt_tokens=prompt_len)


class CoreBackend:
    kind = "builtin"

    def __init__(
        self,
        process: CoreProcess | CoreRef,
        tokenizer,
        *,
        on_death: Callable[[str], None] | None = None,
        client: int = 0,
        clients: int = 1,
    ):
        self.process = process
        self.client, self.clients = client, clients
        # called after another client's parameter change is applied here (the metrics'
        # live-config gauge: ddserve.api.observability.MeteredBackend)
        self.on_params: Callable[[], None] | None = None
        self.tokenizer = tokenizer
        self.on_death = on_death
        self.model_id = process.cfg.model_id
        self.params: LiveParams = process.cfg.params
        self.config: dict = process.cfg.model_dump(mode="json")
        self.fingerprint = process.cfg.fingerprint()
        self.max_context = process.cfg.max_context or 2048
        self.last_success = 0.0  # monotonic time of the last request that completed
        self._info: dict = {}
        self._load: dict = {}
        self._streams: dict[int, _Stream] = {}
        self._calls: dict[int, tuple[asyncio.Future, str]] = {}  # call id -> (answer, method)
        # ids of this client's requests and calls: client, client + N, ... (ddserve.engine.ipc)
        self._ids = itertools.count(clients + client, clients)
        self._dead: EngineUnavailable | None = None
        self._tasks: list[asyncio.Task] = []
        self._ctx = zmq.asyncio.Context()
        # sends are plain non-blocking calls (no HWM: they never wait), not asyncio futures:
        # at a burst of arrivals the future machinery cost more than the send itself
        self._push = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PUSH)
        self._pull = self._ctx.socket(zmq.PULL)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)

    @property
    def url(self) -> str:
        return self.process.url

    # -- start-up -----------------------------------------------------------------------
    @classmethod
    async def start(
        cls,
        cfg: EngineConfig,
        tokenizer,
        *,
        timeout: float,
        log_path: str | Path | None = None,
        env: dict | None = None,
        on_death: Callable[[str], None] | None = None,
        clients: int = 1,
    ) -> CoreBackend:
        """Start a core process and wait until it is ready (weights loaded, warmed up, a real
        generation done); its start-up error is raised here as what it is. This backend is
        its client 0 of `clients` (the others `attach`)."""
        process = CoreProcess(cfg, log_path=log_path, env=env, clients=clients)
        backend = cls(process, tokenizer, on_death=on_death, clients=clients)
        process.start()
        return await backend._open(timeout)

    @classmethod
    async def attach(
        cls,
        cfg: EngineConfig,
        tokenizer,
        *,
        pid: int,
        url: str,
        client: int,
        clients: int,
        timeout: float = 60.0,
        on_death: Callable[[str], None] | None = None,
    ) -> CoreBackend:
        """Join the running core `pid` at `url` as client `client` of `clients` (it answers
        HELLO with READY: its live config now)."""
        backend = cls(
            CoreRef(cfg, pid, url), tokenizer, on_death=on_death, client=client, clients=clients
        )
        return await backend._open(timeout)

    async def _open(self, timeout: float) -> CoreBackend:
        """Connected and READY, or closed and the reason raised."""
        try:
            await self._connect(timeout)
        except BaseException:
            await self.aclose()
            raise
        return self

    async def _connect(self, timeout: float) -> None:
        self._push.connect(self.process.in_addr)
        self._pull.connect(ipc.out_address(self.process.out_addr, self.client))
        if self.client:
            self._send([ipc.HELLO, self.client])
        deadline = time.monotonic() + timeout
        while True:
            if await self._pull.poll(200):
                msg = ipc.unpack(await self._pull.recv())
                if msg[0] == ipc.FAILED:  # it exits by itself: let it
                    await asyncio.to_thread(self.process.wait, 10)
                    raise ipc.error_from_wire(*msg[1:4])
                if msg[0] == ipc.PARAMS:  # a change before its READY, which is newer
                    self._send([ipc.ACK, msg[1], self.client])
                if msg[0] == ipc.READY:
                    self._ready(msg[1])
                    break
            if not self.process.alive():
                tail = self.process.log_tail()
                raise EngineUnavailable(
                    f"engine core exited{self._exit_code()} before it was ready"
                    + (f" ({tail})" if tail else "")
                )
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"engine core not ready within {timeout:.0f}s")
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._watch())]

    def _ready(self, info: dict) -> None:
        self._info = info
        self.config = info["config"]
        self.params = LiveParams.model_validate(info["config"]["params"])
        self.fingerprint = info["fingerprint"]
        self.max_context = info["max_context"]

    # -- the channel --------------------------------------------------------------------
    async def _read(self) -> None:
        try:
            await self._read_forever()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken channel: fail everything now rather than hang
            log.error("engine core channel failed: %s", exc, exc_info=exc)
            self._fail_all(EngineUnavailable(f"engine core channel failed: {exc}"))

    async def _read_forever(self) -> None:
        while True:
            msg = ipc.unpack(await self._pull.recv())
            kind = msg[0]
            if kind == ipc.OUTPUTS:
                _, self.fingerprint, entries, self._load = msg
                for entry in entries:
                    s = self._streams.get(entry[0])
                    if s is not None:
                        s.queue.put_nowait(entry)
            elif kind == ipc.REPLY:
                fut, method = self._calls.pop(msg[1], (None, None))
                # the core's live config in force here in channel order (a PARAMS read
                # after this answer is newer; the caller resumes only later)
                if msg[2] == 200 and method in ("info", "update_params"):
                    self._ready(msg[3]["info"] if method == "update_params" else msg[3])
                if fut is not None and not fut.done():
                    fut.set_result((msg[2], msg[3]))
            elif kind == ipc.PARAMS:  # another client changed them: in force here first
                self._ready(msg[2])
                if self.on_params is not None:
                    self.on_params()
                self._send([ipc.ACK, msg[1], self.client])

    async def _watch(self) -> None:
        while self.process.alive():
            await asyncio.sleep(WATCH_S)
        msg = f"engine core process {self.process.pid} exited{self._exit_code()}"
        log.error("%s; failing %d requests in flight", msg, len(self._streams))
        self._fail_all(EngineUnavailable(msg))

    def _exit_code(self) -> str:
        """ " with code N" when this process started the core (and so can read its code)."""
        proc = self.process.proc
        return (
            f" with code {proc.returncode}"
            if proc is not None and proc.returncode is not None
            else ""
        )

    def _fail_all(self, exc: EngineUnavailable) -> None:
        """Every stream and call in flight ends with `exc`; so does every later one."""
        if self._dead is not None:
            return
        self._dead = exc
        for s in self._streams.values():
            s.queue.put_nowait(exc)
        for fut, _ in self._calls.values():
            if not fut.done():
                fut.set_exception(exc)
        self._calls.clear()
        if self.on_death is not None:
            self.on_death(exc.message)

    def _send(self, msg: list) -> None:
        try:
            self._push.send(ipc.pack(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise EngineUnavailable(f"engine core channel: {exc}") from exc

    def alive(self) -> bool:
        return self._dead is None and self.process.alive()

    async def _call(self, method: str, args: dict, timeout: float = 60.0):
        if self._dead is not None:
            raise self._dead
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (fut, method)
        try:
            self._send([ipc.CALL, call_id, method, args])
        except EngineUnavailable:
            self._calls.pop(call_id, None)
            raise
        try:
            status, payload = await asyncio.wait_for(fut, timeout)
        except TimeoutError as exc:
            self._calls.pop(call_id, None)
            raise EngineUnavailable(
                f"engine core did not answer {method} in {timeout:.0f}s"
            ) from exc
        if status != 200:
            raise error_from_body(status, payload)
        return payload

    # -- Backend ------------------------------------------------------------------------
    async def stream(self, prompt: list[int], sampling: SamplingParams) -> AsyncIterator[Delta]:
        if self._dead is not None:
            raise self._dead
        rid = next(self._ids)
        s = self._streams[rid] = _Stream(len(prompt))
        ts = TextStream(self.tokenizer, sampling)
        finished = False
        try:
            self._send([ipc.ADD, rid, prompt, ipc.sampling_to_wire(sampling)])
            while True:
                entries = [await s.queue.get()]
                while not s.queue.empty():  # coalesce: everything that is here already
                    entries.append(s.queue.get_nowait())
                ids: list[int] = []
                logprobs = Logprobs() if ts.want else None
                finish, error = None, None
                for e in entries:
                    if isinstance(e, BaseException):
                        error = e
                        break
                    _, new, reason, stats, err, lp = e
                    if err is not None:
                        error = error_from_body(err[0], err[1])
                        break
                    ids.extend(new)
                    if logprobs is not None and lp is not None:
                        logprobs.extend(Logprobs.from_wire(lp))
                    if new:
                        s.stats.verify_rounds += 1
                        s.stats.completion_tokens += len(new)
                        s.stats.accept_lengths.append(len(new))
                    if reason is not None:
                        finish = reason
                        if stats is not None:
                            s.stats = ipc.stats_from_wire(stats)
                        break
                text = ts.push(ids, logprobs)
                if error is not None:
                    finished = True  # the engine has let go of it
                    if text or ids:
                        yield Delta(text, ids, self.fingerprint, logprobs=ts.take())
                    raise error
                if ts.stopped:  # a stop string ended it; the abort below frees the slot
                    yield Delta(text, ids, self.fingerprint, "stop", s.stats, ts.take())
                    return
                if finish is not None:
                    finished = True
                    self.last_success = time.monotonic()
                    text += ts.flush()
                    yield Delta(text, ids, self.fingerprint, finish, s.stats, ts.take())
                    return
                if text or ids:
                    yield Delta(text, ids, self.fingerprint, logprobs=ts.take())
        finally:
            self._streams.pop(rid, None)
            if not finished and self._dead is None:
                with contextlib.suppress(EngineUnavailable):
                    self._send([ipc.ABORT, rid])

    async def check_health(self, timeout: float = 60.0) -> float:
        """A real generation of one token with the live sampling defaults."""
        t0 = time.perf_counter()
        p = self.params
        sampling = SamplingParams(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=1, ignore_eos=True
        )

        return await health_generation(self.stream([0], sampling), timeout, t0)

    async def refresh(self) -> None:
        await self._call("info", {})  # applied as it arrives (_read_forever)

    async def update_params(self, changes: dict) -> dict:
        await self._call("update_params", changes)  # applied as it arrives
        return {"params": self.params.model_dump(), "system_fingerprint": self.fingerprint}

    def load_gauges(self) -> dict:
        return dict(self._load)

    def info(self) -> dict:
        load = self._load
        return {
            "engine": "builtin",
            "model": self.model_id,
            "config": self.config,
            "system_fingerprint": self.fingerprint,
            "max_context": self.max_context,
            "load": {
                "running": load.get("num_requests_running", 0),
                "waiting": load.get("num_requests_waiting", 0),
            },
            "load_s": self._info.get("load_s", 0.0),
            "started_at": self._info.get("started_at", 0.0),
            "engine_pid": self.process.pid,
        }

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.to_thread(self.process.stop)
        self._push.close(0)
        self._pull.close(0)
        self._ctx.term()
