"""The engine core: the builtin engine's scheduler in a process of its own.

    python -m ddserve.engine.core IN_ADDR OUT_ADDR [CLIENTS]   (config: env DDSERVE_CORE_CONFIG)

The split of vLLM's API server / EngineCore and SGLang's TokenizerManager / Scheduler: the
worker thread runs DDTree rounds (ddserve.engine.runner) where no HTTP, JSON or
detokenisation can stall it; requests arrive as token ids and outputs leave as token ids,
over the channel of ddserve.engine.ipc, in ONE message per scheduler iteration for all
requests. The main thread only receives (adds, aborts, parameter changes). The client is
ddserve.backends.core (the engine server's API process, or a Ray replica); with CLIENTS > 1,
each of the engine server's API processes (`--api-server-count`) is one, routed by id
(ddserve.engine.ipc).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import zmq

from ddserve.config.engine import EngineConfig
from ddserve.engine import ipc
from ddserve.engine.requests import EngineRequest, StepOutput
from ddserve.engine.runner import EngineRunner
from ddserve.errors import (
    ConfigError,
    DDServeError,
    EngineError,
    InvalidRequest,
    exit_code,
    openai_error_body,
)

log = logging.getLogger("ddserve.engine.core")
PARENT_CHECK_MS = 1000  # how often an idle core looks whether its parent still lives
LOAD_EVERY_S = 0.1  # a client with nothing to read still gets the load this often
READY_WAIT_S = 60.0  # a client's connection READY waits for (it is connecting as it asks)


class _CoreRequest(EngineRequest):
    def __init__(self, rid: int, prompt, sampling, outbox: list):
        super().__init__(prompt, sampling)
        self.rid = rid
        self.outbox = outbox

    def deliver(self, item) -> None:
        self.outbox.append((self.rid, item))  # list.append is atomic; sent by `flush`


class EngineCore:
    """`pushes`: one output socket per client (one unless `--api-server-count` asks more)."""

    def __init__(self, runner: EngineRunner, pushes: list[zmq.Socket]):
        self.runner = runner
        self.pushes = pushes
        self.send_lock = threading.Lock()  # the worker (outputs) and main thread (replies)
        self.outbox: list = []
        self.requests: dict[int, _CoreRequest] = {}
        self.last_sent = [0.0] * len(pushes)
        # a parameter change waiting for the other clients' ACK: call_id -> [caller's client,
        # clients still to ACK]
        self.pending: dict[int, list] = {}
        runner.on_iteration = self.flush

    def send(self, msg: list, client: int = 0, *, wait_s: float = 0.0) -> bool:
        """False when the client is not connected (not yet, or no more: a bound PUSH with no
        peer would block, and neither a client still starting nor a dead one may stall the
        scheduler; with no high-water mark a connected one never does). `wait_s`: how long
        to wait for it to connect (READY: the client asked for it, or started this core,
        and is connecting)."""
        data = ipc.pack(msg)
        deadline = time.monotonic() + wait_s
        while True:
            with self.send_lock:
                try:
                    self.pushes[client].send(data, zmq.NOBLOCK, copy=False)
                    self.last_sent[client] = time.monotonic()
                    return True
                except zmq.Again:
                    pass
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)

    def send_to(self, ident: int, msg: list) -> None:
        """To the client of a request id or call id."""
        self.send(msg, ipc.client_of(ident, len(self.pushes)))

    def info(self) -> dict:
        r = self.runner
        return {
            "model_id": r.config.model_id,
            "config": r.config.model_dump(mode="json"),
            "fingerprint": r.fingerprint,
            "max_context": r.max_context,
            "load_s": round(r.load_s, 2),
            "started_at": r.started_at,
            "drafter": r.engine.drafter.name if r.engine else "",
            "pid": os.getpid(),
        }

    # -- worker thread: once per iteration ---------------------------------------------
    def flush(self) -> None:
        out, self.outbox[:] = list(self.outbox), []
        n = len(self.pushes)
        entries: list[list] = [[] for _ in range(n)]
        for rid, item in out:
            if isinstance(item, StepOutput):
                stats = ipc.stats_to_wire(item.stats) if item.finished else None
                lp = item.logprobs.to_wire() if item.logprobs is not None else None
                entry = [rid, item.token_ids, item.finish_reason, stats, None, lp]
                done = item.finished
            else:
                status, body = openai_error_body(item)
                entry = [rid, [], None, None, [status, body], None]
                done = True
            entries[ipc.client_of(rid, n)].append(entry)
            if done:
                self.requests.pop(rid, None)
        idle = self.runner.load["running"] == 0
        fingerprint, load, now = (
            self.runner.fingerprint,
            self.runner.load_gauges(),
            time.monotonic(),
        )
        for client, mine in enumerate(entries):
            if mine or idle or now - self.last_sent[client] > LOAD_EVERY_S:  # else nothing new
                self.send([ipc.OUTPUTS, fingerprint, mine, load], client)

    # -- main thread ---------------------------------------------------------------------
    def serve(self, pull: zmq.Socket, parent: int | None = None) -> None:
        """Handle the client's messages until SIGTERM, or until `parent` (the process that
        started this one) is gone: the death signal asked for at spawn is a second line, and
        a core left serving after its API process has gone holds its GPU for nothing (one
        was found orphaned, idle in this loop, after a CI run)."""
        while True:
            if parent is not None and not pull.poll(PARENT_CHECK_MS):
                if os.getppid() != parent:
                    log.warning("the process that started this engine core is gone: exiting")
                    return
                continue
            msg = ipc.unpack(pull.recv())
            kind = msg[0]
            if kind == ipc.ADD:
                self._add(msg[1], msg[2], msg[3])
            elif kind == ipc.ABORT:
                req = self.requests.pop(msg[1], None)
                if req is not None:
                    req.cancelled = True
                    self.runner.wake()
            elif kind == ipc.CALL:
                self._call(msg[1], msg[2], msg[3])
            elif kind == ipc.HELLO:
                self.send([ipc.READY, self.info()], msg[1], wait_s=READY_WAIT_S)
            elif kind == ipc.ACK:
                self._acked(msg[1], msg[2])

    def _add(self, rid: int, prompt: list[int], sampling: dict) -> None:
        try:
            req = _CoreRequest(rid, prompt, ipc.sampling_from_wire(sampling), self.outbox)
            self.requests[rid] = req
            self.runner.submit(req)
        except Exception as exc:  # bad ids, an engine going down: this request only
            self.requests.pop(rid, None)
            status, body = openai_error_body(exc)
            self.send_to(
                rid,
                [
                    ipc.OUTPUTS,
                    self.runner.fingerprint,
                    [[rid, [], None, None, [status, body], None]],
                    self.runner.load_gauges(),
                ],
            )

    def _call(self, call_id: int, method: str, args: dict) -> None:
        try:
            if method == "update_params":
                self.runner.update_params(**args)
                if self._broadcast(call_id):
                    return  # answered once every other client has ACKed
                result = self._params_result()
            elif method == "info":
                result = self.info()
            else:
                raise EngineError(f"engine core: no method {method!r}")
            self.send_to(call_id, [ipc.REPLY, call_id, 200, result])
        except Exception as exc:
            if isinstance(exc, ConfigError):  # a bad value in the caller's request
                exc = InvalidRequest(exc.message, param=exc.param)
            status, body = openai_error_body(exc)
            self.send_to(call_id, [ipc.REPLY, call_id, status, body])

    def _params_result(self) -> dict:
        """The live parameters now: what a change's caller applies with its REPLY. Built when
        the REPLY leaves, not when the change was made: a later change through another
        client may have gone out (as PARAMS) in between, and the last word each client reads
        must be the newest."""
        return {"params": self.runner.config.params.model_dump(), "info": self.info()}

    def _broadcast(self, call_id: int) -> bool:
        """The new live parameters to every client but the caller; True when the caller's
        REPLY waits for their ACKs."""
        n = len(self.pushes)
        caller = ipc.client_of(call_id, n)
        info = self.info()
        others = {
            client
            for client in range(n)
            if client != caller  # one not connected yet reads the new info in its READY
            and self.send([ipc.PARAMS, call_id, info], client)
        }
        if not others:
            return False
        self.pending[call_id] = [caller, others]
        return True

    def _acked(self, call_id: int, client: int) -> None:
        p = self.pending.get(call_id)
        if p is None:
            return
        p[1].discard(client)
        if not p[1]:
            del self.pending[call_id]
            self.send([ipc.REPLY, call_id, 200, self._params_result()], p[0])


def main(argv: list[str] | None = None) -> int:
    args = argv or sys.argv[1:]
    in_addr, out_addr = args[:2]
    clients = int(args[2]) if len(args) > 2 else 1
    logging.basicConfig(
        level=os.environ.get("DDSERVE_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )

    # watched while serving (EngineCore.serve): the process that spawned this one, as it
    # says (it may be gone before this line runs), else whoever is the parent now
    parent = int(os.environ.get(ipc.PARENT_ENV) or os.getppid())

    def stop(*_):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.bind(in_addr)
    pushes = []
    for client in range(clients):
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)  # never block the scheduler on a slow reader
        push.setsockopt(zmq.LINGER, 1000)
        push.bind(ipc.out_address(out_addr, client))
        pushes.append(push)
    runner = None
    try:
        config = EngineConfig.model_validate_json(os.environ[ipc.CONFIG_ENV])
        t0 = time.perf_counter()
        runner = EngineRunner(config)
        runner.start()
        core = EngineCore(runner, pushes)
        if not core.send([ipc.READY, core.info()], wait_s=READY_WAIT_S):
            log.error("the process that started this engine core never connected: exiting")
            return 4
        log.info("engine core ready in %.1fs (pid %d)", time.perf_counter() - t0, os.getpid())
        core.serve(pull, parent=parent)
    except (SystemExit, KeyboardInterrupt):
        return 0
    except BaseException as exc:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # exiting already
        if not isinstance(exc, DDServeError):
            log.error("engine core failed", exc_info=exc)
        pushes[0].send(ipc.pack([ipc.FAILED, *ipc.error_to_wire(exc)]))
        return exit_code(exc) if isinstance(exc, DDServeError) else 4
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if runner is not None:
            runner.shutdown()
        pull.close(0)
        for push in pushes:
            push.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
