"""The engine core process seen from its clients (ddserve.backends.core): `CoreProcess` starts,
watches and stops one (its owner: the engine server's first API process, or a Ray replica);
`CoreRef` is the view of a client that joined a core another process owns (the engine
server's other API processes, `--api-server-count`)."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ddserve.backends.process import NOT_INHERITED, ChildProcess, die_with_parent
from ddserve.config.engine import EngineConfig
from ddserve.engine import ipc
from ddserve.errors import EngineUnavailable


class CoreProcess(ChildProcess):
    """Start, watch and stop one engine core process (the same surface as EngineProcess:
    `pid`, `proc`, `alive()`, `stop()`; `url` names its channel)."""

    def __init__(
        self,
        cfg: EngineConfig,
        *,
        log_path: str | Path | None = None,
        env: dict | None = None,
        clients: int = 1,
    ):
        self.cfg = cfg
        self.clients = clients
        self.dir = tempfile.mkdtemp(prefix="ddserve-core-")  # 0700: the sockets are private
        self.in_addr = f"ipc://{self.dir}/in"
        self.out_addr = f"ipc://{self.dir}/out"
        self.url = f"ipc://{self.dir}"
        self.log_path = Path(log_path) if log_path else None
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
        env |= self.env or {}
        env[ipc.CONFIG_ENV] = self.cfg.model_dump_json()
        env[ipc.PARENT_ENV] = str(os.getpid())
        out = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        cmd = [sys.executable, "-m", "ddserve.engine.core", self.in_addr, self.out_addr]
        if self.clients > 1:
            cmd.append(str(self.clients))
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                env=env,
                preexec_fn=die_with_parent,
            )
        except OSError as exc:
            raise EngineUnavailable(f"cannot start the engine core: {exc}") from exc

    def stop(self, grace_s: float = 20.0) -> None:
        super().stop(grace_s)
        shutil.rmtree(self.dir, ignore_errors=True)

    def wait(self, timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)


class CoreRef:
    """A core that another process started and owns, seen from a client that joined it: its
    pid and channel (the surface of CoreProcess that CoreBackend uses). Alive while a pidfd on
    it is not readable: no reaping needed, no confusion with a reused pid."""

    proc = None
    log_path = None

    def __init__(self, cfg: EngineConfig, pid: int, url: str):
        self.cfg = cfg
        self.pid = pid
        self.url = url
        self.in_addr, self.out_addr = f"{url}/in", f"{url}/out"
        try:
            self._fd: int | None = os.pidfd_open(pid)
        except OSError as exc:
            raise EngineUnavailable(f"engine core process {pid} is gone: {exc}") from exc

    def alive(self) -> bool:
        return self._fd is not None and not select.select([self._fd], [], [], 0)[0]

    def stop(self, grace_s: float = 0.0) -> None:
        """Not this process's to stop: let go of the pidfd."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def wait(self, timeout: float) -> None:
        pass

    def log_tail(self) -> str:
        return ""
