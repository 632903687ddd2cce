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
  ahead_of(id)           an older attempt still in progress (the controller refuses a second
                         attempt while one is under way)
  save_deployed(state), deployed()   the config in force after the last success (or `up`)
"""

from __future__ import annotations

import fcntl
import json
import os
from abc import ABC, abstractmethod
from datetime import UTC, datetime
from pathlib import Path

from ddserve.errors import ConfigError

# an in-progress attempt whose controller stopped answering for this long past twice its
# deadline is taken for dead (killed; its record never got an outcome)
STALE_S = 60.0


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

    def ahead_of(self, attempt_id: str, now: datetime | None = None) -> dict | None:
        """An attempt begun before `attempt_id` (a lower id) and still in progress, if any.
        One whose controller died (its record stays `in_progress`) stops counting once twice
        its deadline (the rollout, then its rollback) and STALE_S have passed."""
        now = now or datetime.now(UTC)
        mine = _number(attempt_id)
        for r in self.records():
            if r.get("outcome") != "in_progress" or _number(r["id"]) >= mine:
                continue
            try:
                started = datetime.fromisoformat(r["started"])
            except (KeyError, TypeError, ValueError):
                continue
            limit = 2 * float(r.get("deadline_s", 300.0)) + STALE_S
            if (now - started).total_seconds() <= limit:
                return r
        return None

    def get(self, attempt_id: str) -> dict:
        for r in self.records():
            if r["id"] == attempt_id:
                return r
        raise ConfigError(f"no reconfiguration {attempt_id!r} in {self.where}")


def _number(attempt_id: str) -> int:
    """r0012 -> 12 (ids sort by it: r10000 after r9999)."""
    return int(attempt_id[1:]) if attempt_id[1:].isdigit() else -1


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
