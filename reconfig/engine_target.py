"""Reconfiguration target: one bare engine under a supervisor (the single-box deployment).

The engine reads its config from an EnvironmentFile (`DDSERVE_BUDGET=8`, ... — one variable
per EngineConfig field, see ddserve.config.envfile; lines of other variables such as
DDSERVE_HOST or DDSERVE_ADMIN_TOKEN are kept on every rewrite); a supervisor restarts it:
`SystemdSupervisor` runs `systemctl restart UNIT`; `ProcessSupervisor` runs the engine as a
child process (development, and the tests' stand-in for systemd).

  live     POST /admin/params on the engine (builtin engine: every live parameter), and the
           EnvironmentFile is rewritten so a later restart keeps the values
  restart  rewrite the EnvironmentFile, restart through the supervisor
Verify: real generations against the engine's address until one returns non-empty output
**with the new fingerprint**. An old process that still answers after a restart (systemd
keeps it until it exits) answers with the old fingerprint and does not count.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from ddserve.backends.process import EngineProcess
from ddserve.config import api_key
from ddserve.config.engine import EngineConfig
from ddserve.config.envfile import read_env_file, write_env_file
from ddserve.errors import EngineUnavailable, RolloutFailed, SupervisorError
from ddserve.reconfig.history import History
from ddserve.reconfig.plan import Plan


class SystemdSupervisor:
    def __init__(self, unit: str):
        self.unit = unit

    def restart(self) -> None:
        r = subprocess.run(["systemctl", "restart", self.unit], capture_output=True, text=True)
        if r.returncode != 0:
            raise SupervisorError(
                f"systemctl restart {self.unit} failed: {r.stderr.strip()[-300:]}"
            )


class ProcessSupervisor:
    """Runs `ddserve engine` with the EnvironmentFile's variables, like systemd would."""

    def __init__(self, env_file: Path, port: int, log_path: Path | None = None):
        self.env_file, self.port, self.log_path = env_file, port, log_path
        self.proc: EngineProcess | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "ddserve", "engine", "--port", str(self.port)]
        self.proc = EngineProcess(
            None,
            port=self.port,
            log_path=self.log_path,
            env=read_env_file(self.env_file),
            command=cmd,
        )
        self.proc.start()

    def restart(self) -> None:
        if self.proc is not None:
            self.proc.stop()
        self.start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


class EngineTarget:
    name = "engine"

    def __init__(
        self,
        url: str,
        env_file: Path,
        supervisor,
        history: History,
        *,
        admin_token: str | None = None,
        api_key: str | None = None,
        verify_timeout_s: float = 60.0,
    ):
        self.url = url.rstrip("/")
        self.env_file = Path(env_file)
        self.supervisor = supervisor
        self.history = history
        self.admin_token = admin_token
        self.api_key = api_key
        self.verify_timeout_s = verify_timeout_s

    def current_config(self) -> EngineConfig:
        state = self.history.deployed()
        if state:
            return EngineConfig.model_validate(state["engine"])
        try:
            r = httpx.get(self.url + "/server_info", timeout=10)
            return EngineConfig.model_validate(r.json()["config"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise EngineUnavailable(
                f"no engine answers /server_info at {self.url} ({type(exc).__name__}: {exc}); "
                "start it, or point --url at it"
            ) from exc

    def observe(self) -> list[dict]:
        try:
            info = httpx.get(self.url + "/server_info", timeout=10).json()
            return [
                {"replica": self.url, "state": "RUNNING", "fingerprint": info["system_fingerprint"]}
            ]
        except (httpx.HTTPError, ValueError, KeyError):
            return [{"replica": self.url, "state": "UNREACHABLE", "fingerprint": ""}]

    def apply(
        self,
        desired: EngineConfig,
        plan: Plan,
        attempt: str,
        deadline_s: float,
        progress: Callable[[str], None],
    ) -> list[dict]:
        started = time.monotonic()
        if plan.strategy == "live":
            headers = {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}
            try:
                r = httpx.post(
                    self.url + "/admin/params",
                    json=desired.params.model_dump(),
                    headers=headers,
                    timeout=30,
                )
            except httpx.HTTPError as exc:
                raise RolloutFailed(f"engine unreachable: {type(exc).__name__}") from exc
            if r.status_code != 200:
                raise RolloutFailed(
                    f"engine refused the live change: HTTP {r.status_code} {r.text[:200]}"
                )
            write_env_file(self.env_file, desired, attempt)
        else:
            write_env_file(self.env_file, desired, attempt)
            progress(f"  restarting the engine ({type(self.supervisor).__name__})")
            self.supervisor.restart()
        result = self._verify(desired.fingerprint(), started + deadline_s, progress)
        self.history.save_deployed({"engine": desired.model_dump(mode="json")})
        return [result]

    def _api_headers(self) -> dict[str, str]:
        """The engine's API key: the one given, else the one its EnvironmentFile sets."""
        key = self.api_key
        if key is None and self.env_file.exists():
            key = api_key.read_api_key(environ=read_env_file(self.env_file))
        return api_key.bearer(key)

    def _verify(self, expected: str, deadline: float, progress) -> dict:
        """Real generations until one comes back non-empty with the new fingerprint."""
        seen_old = 0
        last = "no answer yet"
        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
        while time.monotonic() < deadline:
            try:
                r = httpx.post(
                    self.url + "/generate",
                    json=body,
                    headers=self._api_headers(),
                    timeout=self.verify_timeout_s,
                )
                if r.status_code == 200:
                    data = r.json()
                    fp = data.get("system_fingerprint")
                    if fp == expected and data["meta_info"]["completion_tokens"] > 0:
                        progress(
                            f"  engine at {self.url}: verified by a real generation ({seen_old} answers from the old config before)"
                        )
                        return {"replica": self.url, "fingerprint": fp, "old_answers": seen_old}
                    seen_old += 1
                    last = f"answered with fingerprint {fp}, expected {expected}"
                else:
                    last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            time.sleep(0.2)
        raise RolloutFailed(f"engine not verified in time: {last}")
