"""Engine config from its sources: a deploy YAML's `engine:` section, `ddserve engine` flags and
the `DDSERVE_*` variables a systemd unit's EnvironmentFile sets (flag > variable > file)."""

from __future__ import annotations

import json
import os

from ddserve.config.deploy import load_config
from ddserve.config.engine import EngineConfig, validate
from ddserve.errors import ConfigError

# flag -> (path in EngineConfig, type, help); unset flags keep the config file's value or the default
ENGINE_FLAGS = {
    "--model": (
        "model",
        str,
        "smollm2-135m | tiny-random[:SEED] | FILE.gguf | converted DIR (default smollm2-135m)",
    ),
    "--served-name": ("served_name", str, "model id in the OpenAI API (default: --model)"),
    "--drafter": (
        "drafter.kind",
        str,
        "ngram | dflash | draft-model | layer-skip | none (default ngram)",
    ),
    "--dflash-path": (
        "drafter.dflash_path",
        str,
        "trained DFlash drafter directory (--drafter dflash; default: the model's builtin one)",
    ),
    "--draft-model": (
        "drafter.draft_model",
        str,
        "model spec of the draft model (--drafter draft-model)",
    ),
    "--draft-layers": ("drafter.layers", int, "target layers kept by --drafter layer-skip"),
    "--depth": (
        "drafter.depth",
        int,
        "draft positions per round, the tree depth limit (default 8)",
    ),
    "--budget": (
        "params.budget",
        int,
        "draft tree nodes verified per round; 0 = autoregressive (default 8)",
    ),
    "--topk": ("params.topk", int, "candidates per depth (default 4)"),
    "--window": ("params.window", int, "drafter attention window in tokens (default 2048)"),
    "--temperature": ("params.temperature", float, "default temperature, 0 = greedy (default 0)"),
    "--top-p": ("params.top_p", float, "default nucleus mass (default 1)"),
    "--top-k": ("params.top_k", int, "default top-k filter, 0 = off"),
    "--max-context": ("max_context", int, "longest prompt + completion (default: the model's)"),
    "--device": ("device", str, "auto | cpu | cuda"),
    "--max-batch": ("max_batch", int, "requests verified together per round (default 32)"),
    "--dtype": ("dtype", str, "auto | float32 | bfloat16 | float16"),
    "--graphs": (
        "graphs",
        str,
        "static KV pool + CUDA graphs: auto (with CUDA) | on | off (default auto)",
    ),
    "--spec-max-batch": (
        "spec_max_batch",
        int,
        "rounds with more active requests than this verify without a draft (default: always draft)",
    ),
    "--compile": ("compile", str, "torch.compile the static engine: auto (with CUDA) | on | off"),
}


def env_name(flag: str) -> str:
    """--top-p -> DDSERVE_TOP_P: the environment variable an engine flag falls back to."""
    return "DDSERVE_" + flag.lstrip("-").replace("-", "_").upper()


def engine_config_from(
    flag_values: dict[str, object],
    *,
    config_path: str | None = None,
    config_json: str | None = None,
    environ: dict[str, str] | None = None,
) -> EngineConfig:
    """`flag_values` maps a flag (`--budget`) to its value or None (unset)."""
    environ = os.environ if environ is None else environ
    base: dict = {}
    if config_path:
        base = load_config(config_path).engine.model_dump()
    elif config_json:
        try:
            base = json.loads(config_json)
        except ValueError as exc:
            raise ConfigError(f"--config-json is not valid JSON: {exc}") from exc
    for flag, (path, typ, _) in ENGINE_FLAGS.items():
        value = flag_values.get(flag)
        env = environ.get(env_name(flag))
        if value is None and env not in (None, ""):
            try:
                value = typ(env)  # a unit's EnvironmentFile sets DDSERVE_BUDGET=... and so on
            except ValueError as exc:
                raise ConfigError(f"{env_name(flag)}={env!r}: not a valid {typ.__name__}") from exc
        if value is not None:
            *parents, leaf = path.split(".")
            node = base
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = value
    return validate(EngineConfig, base)
