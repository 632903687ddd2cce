"""The engine core: the builtin engine's scheduler in a process of its own.

    python -m ddserve.engine.core IN_ADDR OUT_ADDR      (config: env DDSERVE_CORE_CONFIG)

The split of vLLM's API server / EngineCore and SGLang's TokenizerManager / Scheduler: the
worker thread runs DDTree rounds (ddserve.engine.runner) where no HTTP, JSON or
detokenisation can stall it; requests arrive as token ids and outputs leave as token ids,
over the channel of ddserve.engine.ipc, in ONE message per scheduler iteration for all
requests. The main thread only receives (adds, aborts, parameter changes). The client is
ddserve.backends.core (the engine server's API process, or a Ray replica).
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
from ddserve.engine.runner import EngineRequest, EngineRunner, StepOutput
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


class _CoreRequest(EngineRequest):
    def __init__(self, rid: int, prompt, sampling, outbox: list):
        super().__init__(prompt, sampling)
        self.rid = rid
        self.outbox = outbox

    def deliver(self, item) -> None:
        self.outbox.append((self.rid, item))  # list.append is atomic; sent by `flush`


class EngineCore:
    def __init__(self, runner: EngineRunner, push: zmq.Socket):
        self.runner = runner
        self.push = push
        self.send_lock = threading.Lock()  # the worker (outputs) and main thread (replies)
        self.outbox: list = []
        self.requests: dict[int, _CoreRequest] = {}
        runner.on_iteration = self.flush

    def send(self, msg: list) -> None:
        data = ipc.pack(msg)
        with self.send_lock:
            self.push.send(data, copy=False)

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
        entries = []
        for rid, item in out:
            if isinstance(item, StepOutput):
                stats = ipc.stats_to_wire(item.stats) if item.finished else None
                lp = item.logprobs.to_wire() if item.logprobs is not None else None
                entries.append([rid, item.token_ids, item.finish_reason, stats, None, lp])
                done = item.finished
            else:
                status, body = openai_error_body(item)
                entries.append([rid, [], None, None, [status, body], None])
                done = True
            if done:
                self.requests.pop(rid, None)
        if entries or self.runner.load["running"] == 0:
            self.send([ipc.OUTPUTS, self.runner.fingerprint, entries, self.runner.load_gauges()])

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

    def _add(self, rid: int, prompt: list[int], sampling: dict) -> None:
        try:
            req = _CoreRequest(rid, prompt, ipc.sampling_from_wire(sampling), self.outbox)
            self.requests[rid] = req
            self.runner.submit(req)
        except Exception as exc:  # bad ids, an engine going down: this request only
            self.requests.pop(rid, None)
            status, body = openai_error_body(exc)
            self.send(
                [
                    ipc.OUTPUTS,
                    self.runner.fingerprint,
                    [[rid, [], None, None, [status, body], None]],
                    self.runner.load_gauges(),
                ]
            )

    def _call(self, call_id: int, method: str, args: dict) -> None:
        try:
            if method == "update_params":
                new = self.runner.update_params(**args)
                result = {"params": new.params.model_dump(), "info": self.info()}
            elif method == "info":
                result = self.info()
            else:
                raise EngineError(f"engine core: no method {method!r}")
            self.send([ipc.REPLY, call_id, 200, result])
        except Exception as exc:
            if isinstance(exc, ConfigError):  # a bad value in the caller's request
                exc = InvalidRequest(exc.message, param=exc.param)
            status, body = openai_error_body(exc)
            self.send([ipc.REPLY, call_id, status, body])


def main(argv: list[str] | None = None) -> int:
    in_addr, out_addr = (argv or sys.argv[1:])[:2]
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
    push = ctx.socket(zmq.PUSH)
    pull.setsockopt(zmq.RCVHWM, 0)
    push.setsockopt(zmq.SNDHWM, 0)  # never block the scheduler on a slow reader
    push.setsockopt(zmq.LINGER, 1000)
    pull.bind(in_addr)
    push.bind(out_addr)
    runner = None
    try:
        config = EngineConfig.model_validate_json(os.environ[ipc.CONFIG_ENV])
        t0 = time.perf_counter()
        runner = EngineRunner(config)
        runner.start()
        core = EngineCore(runner, push)
        core.send([ipc.READY, core.info()])
        log.info("engine core ready in %.1fs (pid %d)", time.perf_counter() - t0, os.getpid())
        core.serve(pull, parent=parent)
    except (SystemExit, KeyboardInterrupt):
        return 0
    except BaseException as exc:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # exiting already
        if not isinstance(exc, DDServeError):
            log.error("engine core failed", exc_info=exc)
        push.send(ipc.pack([ipc.FAILED, *ipc.error_to_wire(exc)]))
        return exit_code(exc) if isinstance(exc, DDServeError) else 4
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if runner is not None:
            runner.shutdown()
        pull.close(0)
        push.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
