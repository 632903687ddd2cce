"""Engine config from its sources: `ddserve engine` flags, the `DDSERVE_*` variables (a systemd
unit's EnvironmentFile, a replica's engine process) and a deploy YAML's `engine:` section.

Every source is derived from `EngineConfig`'s fields (name, type, description, default), so a
new field reaches every path without a hand-kept table:

  field path          flag              variable              value
  model               --model           DDSERVE_MODEL         text
  params.budget       --budget          DDSERVE_BUDGET        int
  drafter.kind        --drafter         DDSERVE_DRAFTER       ngram | dflash | ...
  drafter.ngram_max   --ngram-max       DDSERVE_NGRAM_MAX     int
  restart_fields      --restart-fields  DDSERVE_RESTART_FIELDS  JSON list (or a,b,c)
  sglang              --sglang          DDSERVE_SGLANG        JSON object of the section
  served_name         --served-model-name (alias --served-name)
                                        DDSERVE_SERVED_MODEL_NAME (alias DDSERVE_SERVED_NAME)

* A required sub-model (`drafter`, `params`) is flattened: its fields are flags of their own,
  named after the field. A field may name its flag in `json_schema_extra={"flag": ...}`
  (`drafter.kind` is `--drafter`, `drafter.layers` is `--draft-layers`) and older names
  in `{"aliases": [...]}`: each alias is a flag too, and its variable is read after the
  flag's own (an EnvironmentFile written before a rename keeps working).
* An optional sub-model (`sglang`), a list or a dict takes one JSON value; a sub-model's JSON
  is merged over the config file's section.
* The variable of `--top-p` is `DDSERVE_TOP_P`; an empty variable counts as unset.
* Precedence: flag > variable > `--config` file > the field's default.
"""

from __future__ import annotations

import json
import os
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import BaseModel

from ddserve.config.deploy import load_config
from ddserve.config.engine import EngineConfig, validate
from ddserve.errors import ConfigError

# DDSERVE_* variables that are not engine fields: no field may derive one of these names
RESERVED_VARS = {
    "DDSERVE_HOST",
    "DDSERVE_PORT",
    "DDSERVE_ADMIN_TOKEN",
    "DDSERVE_ADMIN_TOKEN_FILE",
    "DDSERVE_API_KEY",
    "DDSERVE_API_KEY_FILE",
    "DDSERVE_THREADS",
    "DDSERVE_DECODE_PRIORITY",
    "DDSERVE_CACHE",
    "DDSERVE_STATE_DIR",
    "DDSERVE_RAY_HEAD",
    "DDSERVE_RAY_LOOPBACK",
    "DDSERVE_DASHBOARD_PNG",
}
# flags of `ddserve engine` that are not engine fields
RESERVED_FLAGS = {
    "--host",
    "--port",
    "--config",
    "--log-level",
    "--admin-token",
    "--admin-token-file",
    "--api-key",
    "--api-key-file",
}


@dataclass(frozen=True)
class FieldFlag:
    """One EngineConfig field as a flag and a variable."""

    path: str  # "drafter.ngram_max"
    flag: str  # "--ngram-max"
    env: str  # "DDSERVE_NGRAM_MAX"
    kind: str  # "str" | "int" | "float" | "bool" | "choice" | "list" | "object"
    choices: tuple[str, ...]
    optional: bool  # None is a valid value
    default: Any  # in model_dump(mode="json") form
    help: str
    merge: bool = False  # an optional sub-model: its JSON is merged over the file's section
    aliases: tuple[str, ...] = ()  # older flag names: "--served-name"

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    @property
    def alias_envs(self) -> tuple[str, ...]:
        """Variables of the aliases, read when the flag's own variable is unset."""
        return tuple(env_name(a) for a in self.aliases)


def env_name(flag: str) -> str:
    """--top-p -> DDSERVE_TOP_P: the environment variable an engine flag falls back to."""
    return "DDSERVE_" + flag.lstrip("-").replace("-", "_").upper()


def _unwrap(annotation) -> tuple[Any, bool]:
    """(the type without None and Annotated metadata, whether None is allowed)."""
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if len(args) != 1:
            raise ConfigError(f"{annotation}: only X | None unions can become a flag")
        annotation = args[0]
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation, optional


def _kind(tp) -> tuple[str, tuple[str, ...]]:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "choice", tuple(str(c) for c in typing.get_args(tp))
    if origin is list:
        return "list", ()
    if origin is dict or (isinstance(tp, type) and issubclass(tp, BaseModel)):
        return "object", ()
    for t in (bool, int, float, str):  # bool before int: bool is an int
        if tp is t:
            return t.__name__, ()
    raise ConfigError(f"{tp}: no flag encoding for this type")


def _derive(model: type[BaseModel], prefix: str = "") -> list[FieldFlag]:
    out = []
    for name, field in model.model_fields.items():
        tp, optional = _unwrap(field.annotation)
        path = prefix + name
        if isinstance(tp, type) and issubclass(tp, BaseModel) and not optional:
            out += _derive(tp, path + ".")  # drafter.*, params.*: flags of their own
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        flag = extra.get("flag") or "--" + name.replace("_", "-")
        kind, choices = _kind(tp)
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        out.append(
            FieldFlag(
                path=path,
                flag=flag,
                env=env_name(flag),
                kind=kind,
                choices=choices,
                optional=optional,
                default=default,
                help=field.description or "",
                merge=kind == "object" and isinstance(tp, type) and issubclass(tp, BaseModel),
                aliases=tuple(extra.get("aliases", ())),
            )
        )
    return out


def _check_unique(specs: list[FieldFlag]) -> list[FieldFlag]:
    seen: dict[str, str] = {}
    for s in specs:
        for name in (s.flag, s.env, *s.aliases, *s.alias_envs):
            if name in seen or name in RESERVED_FLAGS | RESERVED_VARS:
                raise ConfigError(
                    f"{s.path} and {seen.get(name, 'ddserve')} both derive {name}; "
                    'name one flag with Field(json_schema_extra={"flag": ...})'
                )
            seen[name] = s.path
    return specs


# every EngineConfig field, in model order: the one table flags, variables and env files use
ENGINE_FIELDS: tuple[FieldFlag, ...] = tuple(_check_unique(_derive(EngineConfig)))
BY_FLAG = {s.flag: s for s in ENGINE_FIELDS}
BY_PATH = {s.path: s for s in ENGINE_FIELDS}
# variables of flag aliases: read by `ddserve engine`, never written, dropped on a rewrite
ALIAS_VARS = frozenset(v for s in ENGINE_FIELDS for v in s.alias_envs)


def parse_value(spec: FieldFlag, raw: object, source: str) -> object:
    """A flag's or variable's text as the field's value; scalars are converted and checked
    by pydantic (one rule for every source), JSON-valued fields are decoded here."""
    if not isinstance(raw, str):
        return raw
    if spec.kind in ("int", "float"):
        try:  # so that an error shows the number: params.budget=-1
            return int(raw) if spec.kind == "int" else float(raw)
        except ValueError:
            return raw  # pydantic names the field and the type
    if spec.kind not in ("list", "object"):
        return raw
    text = raw.strip()
    if spec.kind == "list" and not text.startswith("["):
        return [item.strip() for item in text.split(",") if item.strip()]  # a,b,c
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{source}={raw!r}: not valid JSON ({exc})", param=spec.path) from exc


def encode_value(spec: FieldFlag, value: object) -> str:
    """A field's value (model_dump(mode="json") form) as the text of its flag or variable;
    None is the empty text (unset)."""
    if value is None:
        return ""
    if spec.kind in ("list", "object"):
        return json.dumps(value, separators=(",", ":"))
    if spec.kind == "bool":
        return "true" if value else "false"
    return str(value)  # float: repr, exact on the way back


def field_value(data: dict, path: str) -> object:
    for key in path.split("."):
        data = data[key]
    return data


def _assign(data: dict, spec: FieldFlag, value: object) -> None:
    *parents, leaf = spec.path.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    if spec.merge and isinstance(value, dict) and isinstance(node.get(leaf), dict):
        value = {**node[leaf], **value}
    node[leaf] = value


def engine_config_from(
    flag_values: dict[str, object],
    *,
    config_path: str | None = None,
    environ: typing.Mapping[str, str] | None = None,
) -> EngineConfig:
    """`flag_values` maps a flag (`--budget`) to its text (a bool for bool fields) or None
    (unset); unset flags fall back to `environ`'s variables, then to the config file."""
    environ = os.environ if environ is None else environ
    data: dict = load_config(config_path).engine.model_dump() if config_path else {}
    origin: dict[str, str] = {}
    for spec in ENGINE_FIELDS:
        raw, source = flag_values.get(spec.flag), spec.flag
        for env in (spec.env, *spec.alias_envs):
            if raw is not None:
                break
            raw, source = environ.get(env), env
            if raw is not None and not raw.strip():
                raw = None  # DDSERVE_MAX_CONTEXT= : unset
        if raw is None:
            continue
        _assign(data, spec, parse_value(spec, raw, source))
        origin[spec.path] = source
    try:
        return validate(EngineConfig, data)
    except ConfigError as exc:
        param = exc.param or ""
        source = next(
            (src for path, src in origin.items() if param == path or param.startswith(path + ".")),
            None,
        )
        if source is None:
            raise
        raise ConfigError(f"{exc.message} (set by {source})", param=exc.param) from exc


def config_environ(cfg: EngineConfig) -> dict[str, str]:
    """Every field of `cfg` as its variable (None as the empty text): with these and nothing
    else, `ddserve engine` serves exactly `cfg`."""
    data = cfg.model_dump(mode="json")
    return {s.env: encode_value(s, field_value(data, s.path)) for s in ENGINE_FIELDS}
