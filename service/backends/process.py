"""Start, watch and stop one engine process (builtin or SGLang) on a loopback port.

The replica (Ray), the reconfig controller and systemd-less tests all use this. The child
gets PR_SET_PDEATHSIG so it dies with its parent: no orphaned engines holding GPUs.
Readiness is a real generation (`/health_generate`), never "the port answers".
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ddserve.backends.sglang import sglang_command, sglang_environ
from ddserve.config import api_key
from ddserve.config.admin_token import DEFAULT_ENV
from ddserve.config.engine import EngineConfig
from ddserve.config.flags import ALIAS_VARS, config_environ
from ddserve.errors import EngineUnavailable

log = logging.getLogger(__name__)
ADMIN_FILE_ENV = DEFAULT_ENV + "_FILE"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    os.setpgrp()  # own process group: stop() signals the engine and its children together


def engine_command(cfg: EngineConfig, host: str, port: int) -> list[str]:
    """SGLang: its launcher with flags. Builtin: `ddserve engine`, configured by the DDSERVE_*
    variables of `engine_environ(cfg)`, exactly as a systemd unit's EnvironmentFile does."""
    if cfg.kind == "sglang":
        return sglang_command(cfg, host, port)
    return [sys.executable, "-m", "ddserve", "engine", "--host", host, "--port", str(port)]


def engine_environ(cfg: EngineConfig) -> dict[str, str]:
    """Variables the engine process of `cfg` starts with (every field: nothing inherited
    from this process's own DDSERVE_* variables leaks into the engine's config; SGLang: the
    tree parameters its build reads from the environment)."""
    return config_environ(cfg) if cfg.kind == "builtin" else sglang_environ(cfg)


# inherited variables an engine child must not see: flag aliases (DDSERVE_SERVED_NAME would
# configure it behind its config's back) and the API key (the engine listens on loopback
# behind its replica, which checks the key; the replica's own requests carry none)
NOT_INHERITED = ALIAS_VARS | {api_key.DEFAULT_ENV, api_key.DEFAULT_ENV + "_FILE"}


class ChildProcess:
    """What every engine child shares: its pid, whether it lives, stopping its whole process
    group (SIGTERM, then SIGKILL after `grace_s`), and the tail of its log."""

    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        except ProcessLookupError:
            pass

    def log_tail(self) -> str:
        """Its last three log lines, or "" without a log."""
        if not self.log_path or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:])[-500:]


class EngineProcess(ChildProcess):
    def __init__(
        self,
        cfg: EngineConfig | None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        admin_token: str | None = None,
        log_path: str | Path | None = None,
        env: dict | None = None,
        command: list[str] | None = None,
    ):
        """`command` replaces the one built from `cfg` (a supervisor that configures the
        engine through its environment, as a systemd unit does)."""
        self.cfg = cfg
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.admin_token = admin_token
        self.log_path = Path(log_path) if log_path else None
        self.env = env
        self.command = command
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        inherited = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
        env = {**inherited, **(engine_environ(self.cfg) if self.cfg else {}), **(self.env or {})}
        if self.admin_token:
            env[DEFAULT_ENV] = self.admin_token
            env.pop(ADMIN_FILE_ENV, None)  # one source of the token
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        cmd = self.command or engine_command(self.cfg, self.host, self.port)
        log.info("starting engine: %s", " ".join(cmd[:4]) + " ...")
        try:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent
            )
        except OSError as exc:
            raise EngineUnavailable(f"cannot start engine {cmd[0]}: {exc}") from exc

    def wait_ready(self, timeout: float) -> str:
        """Until a real generation succeeds; returns the engine's fingerprint."""
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if not self.alive():
                raise EngineUnavailable(
                    f"engine exited with code {self.proc.returncode} before it was ready ({self.log_tail() or 'no log'})"
                )
            try:
                r = httpx.get(
                    self.url + "/health_generate",
                    timeout=min(60.0, max(1.0, deadline - time.monotonic())),
                )
                if r.status_code == 200:
                    return (
                        r.json().get("system_fingerprint", "")
                        if r.headers.get("content-type", "").startswith("application/json")
                        else ""
                    )
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            time.sleep(0.2)
        raise EngineUnavailable(f"engine not ready within {timeout:.0f}s (last: {last})")
