"""The Ray target's reconfiguration state, kept by the cluster itself.

Ray's KV store (held by the cluster's GCS), namespace `ddserve-state`, per application:
  <app>/deployed          the config in force: {serve_config, params, admin_sha}
  <app>/attempt/<id>      one JSON object per attempt (in progress, then final)
Any driver connected to the cluster reads and writes the same state, from any machine: the
history no longer depends on who ran the CLI where. It lives as long as the cluster's GCS
(a head restarted without GCS fault tolerance starts empty: the deploy YAML is the fallback).
Ids are claimed with a put that never overwrites, so two controllers never share one.
"""

from __future__ import annotations

import json

from ddserve.reconfig.history import HistoryStore

STATE_NS = "ddserve-state"


def _kv():
    from ray.experimental import internal_kv

    return internal_kv


class RayHistory(HistoryStore):
    def __init__(self, app_name: str):
        self.app = app_name
        self.where = f"the Ray cluster's KV store ({STATE_NS}: {app_name}/)"

    def _get(self, key: str) -> dict | None:
        raw = _kv()._internal_kv_get(key, namespace=STATE_NS)
        return json.loads(raw) if raw else None

    def _put(self, key: str, value: dict, overwrite: bool = True) -> bool:
        """Whether the key existed before."""
        return _kv()._internal_kv_put(
            key, json.dumps(value, sort_keys=True), overwrite=overwrite, namespace=STATE_NS
        )

    def records(self) -> list[dict]:
        keys = _kv()._internal_kv_list(f"{self.app}/attempt/", namespace=STATE_NS)
        found = [self._get(k.decode() if isinstance(k, bytes) else k) for k in keys]
        return sorted((r for r in found if r), key=lambda r: (len(r["id"]), r["id"]))

    def append(self, record: dict) -> None:
        self._put(f"{self.app}/attempt/{record['id']}", record)

    def _claim(self, attempt_id: str, record: dict) -> bool:
        return not self._put(f"{self.app}/attempt/{attempt_id}", record, overwrite=False)

    def save_deployed(self, state: dict) -> None:
        self._put(f"{self.app}/deployed", state)

    def deployed(self) -> dict | None:
        return self._get(f"{self.app}/deployed")
