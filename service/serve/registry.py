"""Replica records in Ray's KV store: each replica publishes its state, the CLI and the
reconfig controller read them (`ddserve status`, rollout verification)."""

from __future__ import annotations

import json

REGISTRY_NS = "ddserve"


def _kv():
    from ray.experimental import internal_kv

    return internal_kv


def publish_status(app_name: str, replica_id: str, status: dict) -> None:
    """Record this replica's state for `ddserve status` and the reconfig controller."""
    _kv()._internal_kv_put(
        f"{app_name}/{replica_id}", json.dumps(status), overwrite=True, namespace=REGISTRY_NS
    )


def drop_status(app_name: str, replica_id: str) -> None:
    _kv()._internal_kv_del(f"{app_name}/{replica_id}", namespace=REGISTRY_NS)


def replica_states(app_name: str) -> list[dict]:
    kv, out = _kv(), []
    for key in kv._internal_kv_list(f"{app_name}/", namespace=REGISTRY_NS):
        raw = kv._internal_kv_get(key, namespace=REGISTRY_NS)
        if raw:
            out.append(json.loads(raw))
    return sorted(out, key=lambda s: s["replica"])


def forget_replicas(app_name: str, replica_ids: list[str]) -> None:
    for rid in replica_ids:
        drop_status(app_name, rid)
