"""Replica records: each replica publishes a typed record of its state into Ray's KV store;
`ddserve status`, `ddserve reconfig status` and rollout verification read them through
`replica_view`, which applies the one staleness rule and asks Ray whether each replica's
actor still lives.

States (ReplicaState). Published by the replica:
  STARTING     its engine process runs, no real generation has passed yet
  RUNNING      proven by a real generation (at start, on reconfigure, at every health check)
  UNHEALTHY    a health check failed (Serve replaces it if the checks keep failing)
  FAILED       the constructor or a reconfigure failed; `error` says why
  DEAD         its engine exited and the replica stopped itself
Derived by the reader (`effective_state`), whatever the record says:
  DEAD         the replica's actor is gone (killed, its node lost): Ray says so at once
  STALE        not refreshed for `stale_after(health period)`: health checks stopped
  UNREACHABLE  (the bare engine target) the engine does not answer
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from enum import StrEnum

REGISTRY_NS = "ddserve"
FAILED_KEPT_S = 3600.0  # a failed start stays visible this long (the controller reads its reason)


class ReplicaState(StrEnum):
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    UNHEALTHY = "UNHEALTHY"
    FAILED = "FAILED"
    DEAD = "DEAD"
    STALE = "STALE"
    UNREACHABLE = "UNREACHABLE"


REFRESHED = (ReplicaState.RUNNING, ReplicaState.UNHEALTHY)  # re-published every health check
ENDED = (ReplicaState.FAILED, ReplicaState.DEAD)


@dataclass(frozen=True)
class ReplicaRecord:
    """What one replica says about itself (JSON in Ray's KV; only plain data)."""

    replica: str
    state: ReplicaState
    error: str = ""
    node: str = ""
    node_id: str = ""
    actor: str = ""  # the replica's Ray actor name ("" outside a replica): liveness
    engine: str = ""
    engine_url: str = ""
    engine_pid: int | None = None
    fingerprint: str = ""
    params: dict = field(default_factory=dict)
    attempt: str = ""
    verified_at: float = 0.0
    healthy_at: float = 0.0
    updated: float = 0.0

    @classmethod
    def from_dict(cls, d: dict) -> ReplicaRecord:
        """Tolerant of fields it does not know (a newer replica) and of missing ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in d.items() if k in known}
        return cls(**{**data, "state": ReplicaState(d["state"])})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def age_s(self, now: float | None = None) -> float:
        return (now or time.time()) - self.updated


def stale_after(health_period_s: float) -> float:
    """A replica re-publishes its record at every health check (every `health_period_s`);
    three missed checks, plus slack, and the record is stale."""
    return 3 * health_period_s + 5


def effective_state(
    r: ReplicaRecord, *, health_period_s: float, alive: bool | None, now: float | None = None
) -> ReplicaState:
    """The one rule for what a record means now. `alive`: whether Ray still has the
    replica's actor (None: unknown, e.g. a record without an actor name)."""
    if alive is False and r.state not in ENDED:
        return ReplicaState.DEAD
    if r.state in REFRESHED and r.age_s(now) > stale_after(health_period_s):
        return ReplicaState.STALE
    return r.state


def forgotten(r: ReplicaRecord, *, health_period_s: float, now: float | None = None) -> bool:
    """Whether a record (with its effective state) is old enough to be dropped."""
    if r.state == ReplicaState.FAILED:
        return r.age_s(now) > FAILED_KEPT_S
    if r.state in (ReplicaState.DEAD, ReplicaState.STALE):
        return r.age_s(now) > 2 * stale_after(health_period_s)
    return False


def _kv():
    from ray.experimental import internal_kv

    return internal_kv


def _key(app_name: str, replica: str) -> str:
    return f"{app_name}/{replica}"


def publish(app_name: str, record: ReplicaRecord) -> None:
    """Record this replica's state for `ddserve status` and the reconfig controller."""
    _kv()._internal_kv_put(
        _key(app_name, record.replica),
        json.dumps(record.to_dict()),
        overwrite=True,
        namespace=REGISTRY_NS,
    )


def drop(app_name: str, replica: str) -> None:
    _kv()._internal_kv_del(_key(app_name, replica), namespace=REGISTRY_NS)


def published_records(app_name: str) -> list[ReplicaRecord]:
    """The records as published, nothing derived (see `replica_view`)."""
    kv, out = _kv(), []
    for key in kv._internal_kv_list(f"{app_name}/", namespace=REGISTRY_NS):
        raw = kv._internal_kv_get(key, namespace=REGISTRY_NS)
        if raw:
            out.append(ReplicaRecord.from_dict(json.loads(raw)))
    return sorted(out, key=lambda r: r.replica)


def live_actors() -> set[str] | None:
    """Names of the named actors Ray has alive now (one GCS call; a killed actor's name is
    released at once); None when Ray cannot say."""
    import ray

    try:
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    except (ray.exceptions.RayError, ConnectionError, RuntimeError):
        return None  # liveness refines the view; the staleness rule still holds


def replica_view(
    app_name: str, health_period_s: float, *, now: float | None = None
) -> list[ReplicaRecord]:
    """Every replica of the application with its effective state; records old enough to be
    forgotten are dropped from the store."""
    now = now or time.time()
    actors = live_actors()
    out = []
    for r in published_records(app_name):
        alive = None if actors is None or not r.actor else r.actor in actors
        state = effective_state(r, health_period_s=health_period_s, alive=alive, now=now)
        r = dataclasses.replace(r, state=state)
        if forgotten(r, health_period_s=health_period_s, now=now):
            drop(app_name, r.replica)
            continue
        out.append(r)
    return out


def as_record(r: ReplicaRecord | dict) -> ReplicaRecord:
    """A target's observation as a record (the bare engine target reports plain dicts)."""
    return r if isinstance(r, ReplicaRecord) else ReplicaRecord.from_dict(r)
