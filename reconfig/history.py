"""Durable record of every reconfiguration attempt, and of the deployed config.

The state belongs to the deployment, not to whoever ran the CLI:
  Ray target     the cluster's own KV store (`RayHistory`, reconfig/ray_history.py): every
                 driver connected to the cluster, from any machine, reads the same state
  engine target  files in the engine's own state directory (`FileHistory`): next to its
                 EnvironmentFile unless the unit names one (reconfig/targets.py)

One interface (`HistoryStore`):
  begin(record) -> id    records an attempt in progress under a fresh id (r0001, r0002, ...);
                         two controllers never get the same id
  append(record)         records the attempt's final state (replaces the in-progress one)
  records(), get(id)     every attempt, in order; one by id
  save_deployed(state), deployed()   the config in force after the last success (or `up`)
"""

from __future__ import annotations

import fcntl
import json
import os
from abc import ABC, abstractmethod
from pathlib import Path

from ddserve.errors import ConfigError


class HistoryStore(ABC):
    where = "?"  # where the state lives, for messages

    @abstractmethod
    def records(self) -> list[dict]: ...

    @abstractmethod
    def append(self, record: dict) -> None: ...

    @abstractmethod
    def save_deployed(self, state: dict) -> None: ...

    @abstractmethod
    def deployed(self) -> dict | None: ...

    @abstractmethod
    def _claim(self, attempt_id: str, record: dict) -> bool:
        """Store `record` under `attempt_id` unless that id is taken; whether it was free."""

    def begin(self, record: dict) -> str:
        n = len(self.records())
        while True:
            n += 1
            attempt_id = f"r{n:04d}"
            if self._claim(attempt_id, {**record, "id": attempt_id}):
                return attempt_id

    def get(self, attempt_id: str) -> dict:
        for r in self.records():
            if r["id"] == attempt_id:
                return r
        raise ConfigError(f"no reconfiguration {attempt_id!r} in {self.where}")


def latest_per_id(records: list[dict]) -> list[dict]:
    """Records in order of their first appearance, each id at its last state."""
    out: dict[str, dict] = {}
    for r in records:
        out[r["id"]] = r
    return list(out.values())


class FileHistory(HistoryStore):
    """<dir>/history.jsonl: one JSON object per line, appended and fsynced (an attempt's
    final line supersedes its in-progress one); <dir>/deployed.json: replaced atomically."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "history.jsonl"
        self.deployed_path = self.dir / "deployed.json"
        self.where = str(self.path)

    def append(self, record: dict) -> None:
        with open(self.path, "a") as f:
            self._write(f, record)

    @staticmethod
    def _write(f, record: dict) -> None:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())

    def _lines(self, text: str) -> list[dict]:
        out = []
        for line in text.splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue  # a torn last line from a crash; the rest stays readable
        return out

    def records(self) -> list[dict]:
        if not self.path.exists():
            return []
        return latest_per_id(self._lines(self.path.read_text()))

    def _claim(self, attempt_id: str, record: dict) -> bool:
        with open(self.path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released on close
            f.seek(0)
            if any(r.get("id") == attempt_id for r in self._lines(f.read())):
                return False
            self._write(f, record)
            return True

    def save_deployed(self, state: dict) -> None:
        tmp = self.deployed_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
        os.replace(tmp, self.deployed_path)

    def deployed(self) -> dict | None:
        if not self.deployed_path.exists():
            return None
        return json.loads(self.deployed_path.read_text())


class History(FileHistory):
    """FileHistory under `root/target` (the engine target and its tests name it so)."""

    def __init__(self, target: str, root: Path):
        super().__init__(Path(root) / target)
