"""Durable record of every reconfiguration attempt, and of the deployed config.

State directory: $DDSERVE_STATE_DIR, default ~/.local/state/ddserve. Per target:
  <target>/history.jsonl   one JSON object per attempt (appended, fsynced)
  <target>/deployed.json   the config in force after the last successful attempt (or `up`)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ddserve.errors import ConfigError


def state_root() -> Path:
    return Path(os.environ.get("DDSERVE_STATE_DIR", Path.home() / ".local" / "state" / "ddserve"))


class History:
    def __init__(self, target: str, root: Path | None = None):
        self.dir = (root or state_root()) / target
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "history.jsonl"
        self.deployed_path = self.dir / "deployed.json"

    def append(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def records(self) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue  # a torn last line from a crash; the rest stays readable
        return out

    def get(self, attempt_id: str) -> dict:
        for r in self.records():
            if r["id"] == attempt_id:
                return r
        raise ConfigError(f"no reconfiguration {attempt_id!r} in {self.path}")

    def next_id(self) -> str:
        return f"r{len(self.records()) + 1:04d}"

    def save_deployed(self, config: dict) -> None:
        tmp = self.deployed_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(config, indent=1, sort_keys=True))
        os.replace(tmp, self.deployed_path)

    def deployed(self) -> dict | None:
        if not self.deployed_path.exists():
            return None
        return json.loads(self.deployed_path.read_text())
