"""The reconfiguration controller: desired config -> validate -> plan -> apply -> verify -> record.

The same controller drives every target (a Ray Serve application, a bare engine under a
supervisor such as systemd). A target provides:
    current_config() -> EngineConfig      the config in force
    apply(desired, plan, attempt, deadline_s, progress) -> per-replica results
                                          (raises OperationFailed — RolloutFailed,
                                          SupervisorError — with the reason)
A failed apply is rolled back by applying the previous config the same way (verified the
same way). Every attempt is recorded where the target's state lives (reconfig/history.py):
as `in_progress` when it starts, then with its outcome, whatever it is.
"""

from __future__ import annotations

import getpass
import math
import time
from collections.abc import Callable
from datetime import UTC, datetime

from ddserve.config.engine import EngineConfig
from ddserve.errors import ConfigError, OperationFailed
from ddserve.reconfig.history import HistoryStore
from ddserve.reconfig.plan import Plan, desired_config, plan


def describe_plan(p: Plan) -> list[str]:
    if not p.changes:
        return ["nothing to change: the desired config is the one in force"]
    lines = [f"plan: {p.strategy}"]
    for c in p.changes:
        lines.append(f"  {c.field}: {c.old!r} -> {c.new!r}  ({c.strategy})")
    return lines


class Controller:
    def __init__(self, target, history: HistoryStore, progress: Callable[[str], None] = print):
        self.target = target
        self.history = history
        self.progress = progress

    def reconfigure(
        self,
        changes: dict,
        *,
        dry_run: bool = False,
        deadline_s: float = 300.0,
        action: str = "set",
    ) -> dict:
        current = self.target.current_config()
        desired = desired_config(current, changes)  # ConfigError: nothing is touched
        return self.apply(current, desired, dry_run=dry_run, deadline_s=deadline_s, action=action)

    def apply(
        self,
        current: EngineConfig,
        desired: EngineConfig,
        *,
        dry_run: bool = False,
        deadline_s: float = 300.0,
        action: str = "set",
    ) -> dict:
        p = plan(current, desired)
        for line in describe_plan(p):
            self.progress(line)
        if dry_run or p.strategy == "none":
            return {"outcome": "dry-run" if dry_run else "unchanged", "plan": p.to_dict()}
        if not (math.isfinite(deadline_s) and deadline_s > 0):
            raise ConfigError(f"deadline {deadline_s}: a positive number of seconds")
        record = {
            "action": action,
            "target": self.target.name,
            "user": _user(),
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
            "from": current.model_dump(mode="json"),
            "to": desired.model_dump(mode="json"),
            "from_fingerprint": current.fingerprint(),
            "to_fingerprint": desired.fingerprint(),
            "plan": p.to_dict(),
            "outcome": "in_progress",
            "deadline_s": deadline_s,
        }
        # visible at once, from wherever the target's state is read
        attempt = record["id"] = self.history.begin(record)
        t0 = time.monotonic()
        try:
            refusal = self._refusal(attempt, current)
            if refusal is not None:
                record["outcome"], record["error"] = "refused", refusal
                self.progress(f"{attempt}: refused: {refusal}")
                return record
            self.progress(
                f"{attempt}: applying ({p.strategy}) {current.fingerprint()} -> "
                f"{desired.fingerprint()}"
            )
            self._apply_or_roll_back(record, current, desired, p, deadline_s)
        except (
            BaseException
        ) as exc:  # Ctrl-C or a foreign error: the record says so, not "in_progress"
            record["outcome"] = "interrupted"
            record["error"] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            record.setdefault("apply_s", round(time.monotonic() - t0, 2))
            record["total_s"] = round(time.monotonic() - t0, 2)
            self.history.append(record)
        return record

    def _refusal(self, attempt: str, current: EngineConfig) -> str | None:
        """Why this attempt may not go on, if it may not. One attempt at a time: of two begun
        together the older goes on (each sees the other's record once its own is in); and
        the config it was planned against must still be the one in force (one read before
        another attempt ended would revert that attempt's change). Two at once had undone
        each other's change."""
        ahead = self.history.ahead_of(attempt)
        if ahead is not None:
            return (
                f"{ahead['id']} ({ahead.get('user', '?')}, since {ahead['started']}) is still "
                "in progress: one reconfiguration at a time; retry once it has ended "
                "(ddserve reconfig status)"
            )
        now = self.target.current_config().fingerprint()
        if now != current.fingerprint():
            return (
                f"the config in force changed to {now} since this command read "
                f"{current.fingerprint()} (another reconfiguration ended meanwhile); run it again"
            )
        return None

    def _apply_or_roll_back(
        self, record: dict, current: EngineConfig, desired: EngineConfig, p: Plan, deadline_s: float
    ) -> None:
        attempt, t0 = record["id"], time.monotonic()
        try:
            record["replicas"] = self.target.apply(desired, p, attempt, deadline_s, self.progress)
            record["outcome"] = "succeeded"
            return
        except OperationFailed as exc:  # a rollout that did not verify, a failed restart
            record["error"] = exc.message
            record["replicas"] = getattr(exc, "replicas", [])
            record["apply_s"] = round(time.monotonic() - t0, 2)
            self.progress(
                f"{attempt}: FAILED: {exc.message}; rolling back to {current.fingerprint()}"
            )
        t1 = time.monotonic()
        try:
            self.target.apply(
                current, plan(desired, current), f"{attempt}-rollback", deadline_s, self.progress
            )
            record["outcome"] = "rolled_back"
        except OperationFailed as exc2:
            record["outcome"] = "rollback_failed"
            record["rollback_error"] = exc2.message
        record["rollback_s"] = round(time.monotonic() - t1, 2)


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"
