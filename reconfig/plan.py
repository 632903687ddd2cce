"""Validate a desired change and plan it: pure functions, no I/O.

`plan(current, desired)` decides per changed field whether the engine can swap it in place
(*live*) or needs a new engine process (*restart*):
  builtin engine: every live parameter (budget, topk, window, temperature, top_p, top_k)
  sglang:         temperature, top_p, top_k live (applied per request by the replica);
                  budget, topk, window are launch flags -> restart
  any engine:     fields listed in `engine.restart_fields`, and every non-parameter field
                  (model, drafter, dtype, ...) -> restart
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from ddserve.backends.sglang import RESTART_FIELDS as SGLANG_RESTART_FIELDS
from ddserve.config.engine import EngineConfig, LiveParams, validate
from ddserve.errors import ConfigError

SHORTHAND = {name: f"params.{name}" for name in LiveParams.model_fields}


@dataclass(frozen=True)
class FieldChange:
    field: str
    old: Any
    new: Any
    strategy: str  # "live" | "restart"


@dataclass(frozen=True)
class Plan:
    changes: tuple[FieldChange, ...]

    @property
    def strategy(self) -> str:
        if not self.changes:
            return "none"
        return "restart" if any(c.strategy == "restart" for c in self.changes) else "live"

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "changes": [c.__dict__ for c in self.changes]}


def parse_assignments(items: list[str]) -> dict[str, Any]:
    """['budget=16', 'drafter.depth=6'] -> {'params.budget': 16, 'drafter.depth': 6}."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"{item!r}: write FIELD=VALUE, e.g. budget=16")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{item!r}: cannot read the value") from exc
        out[SHORTHAND.get(key, key.removeprefix("engine."))] = value
    return out


def desired_config(current: EngineConfig, changes: dict[str, Any]) -> EngineConfig:
    """Apply dotted changes to the current config and validate the result (ConfigError)."""
    data = current.model_dump()
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = data
        for key in parents:
            if not isinstance(node.get(key), dict):
                raise ConfigError(
                    f"{path}: unknown field (live parameters: {', '.join(SHORTHAND)})"
                )
            node = node[key]
        if leaf not in node:
            raise ConfigError(f"{path}: unknown field (live parameters: {', '.join(SHORTHAND)})")
        node[leaf] = value
    return validate(EngineConfig, data)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "ddtree_flags":
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def live_fields(cfg: EngineConfig) -> set[str]:
    """Live parameters this engine swaps in place."""
    live = set(LiveParams.model_fields) - set(cfg.restart_fields)
    if cfg.kind == "sglang":
        live -= SGLANG_RESTART_FIELDS
    return {f"params.{f}" for f in live}


def plan(current: EngineConfig, desired: EngineConfig) -> Plan:
    old, new = _flatten(current.model_dump()), _flatten(desired.model_dump())
    live = live_fields(current) if current.kind == desired.kind else set()
    changes = [
        FieldChange(key, old.get(key), new.get(key), "live" if key in live else "restart")
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key)
    ]
    return Plan(tuple(changes))
