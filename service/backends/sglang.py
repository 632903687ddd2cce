"""The SGLang launch command and environment for an EngineConfig of kind `sglang` (TP,
DFlash, DDTree).

Upstream flags (checked against SGLang 0.5.23's own argument parser in
tests/test_sglang_launcher.py): --model-path, --tp-size, --speculative-algorithm,
--speculative-draft-model-path, --speculative-num-draft-tokens,
--speculative-draft-window-size, --enable-metrics, --host, --port, --served-model-name.
The DDTree budget/topk (and, in some forks, the window) go by the names of the build:
`sglang.preset` (ddserve.config.sglang_presets) or the spelled-out `ddtree_flags` /
`ddtree_env`; a parameter a build takes as an environment variable is in `sglang_environ`.

Sampling defaults (temperature, top_p, top_k) are not launch flags: the replica applies
them to each request, so changing them needs no restart. Tree parameters and the window do.
"""

from __future__ import annotations

from ddserve.config.engine import EngineConfig
from ddserve.config.sglang_presets import TREE_PARAMS
from ddserve.errors import ConfigError

# Live parameters SGLang needs a restart for; the rest are applied per request.
RESTART_FIELDS = frozenset({"budget", "topk", "window"})


def speculating(cfg: EngineConfig) -> bool:
    """Budget 0 or no drafter: plain decoding, no speculative flags or variables."""
    return cfg.params.budget > 0 and bool(cfg.sglang and cfg.sglang.draft_model_path)


def sglang_environ(cfg: EngineConfig) -> dict[str, str]:
    """Variables the SGLang process starts with: the tree parameters its build reads from
    the environment (sglang-pr-29907: SGLANG_DDTREE_MAX_TOPK=<topk>)."""
    if cfg.kind != "sglang" or cfg.sglang is None or not speculating(cfg):
        return {}
    return {var: str(getattr(cfg.params, name)) for name, var in cfg.sglang.mapping.env.items()}


def sglang_command(cfg: EngineConfig, host: str, port: int) -> list[str]:
    if cfg.kind != "sglang" or cfg.sglang is None:
        raise ConfigError("sglang_command needs engine.kind=sglang with an sglang section")
    s, p = cfg.sglang, cfg.params
    cmd = [
        s.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        cfg.model,
        "--tp-size",
        str(cfg.tp_size),
        "--host",
        host,
        "--port",
        str(port),
        "--enable-metrics",
    ]
    if cfg.served_name:
        cmd += ["--served-model-name", cfg.served_name]
    if speculating(cfg):
        m = s.mapping
        cmd += [
            "--speculative-algorithm",
            m.algorithm,
            "--speculative-draft-model-path",
            s.draft_model_path,
            "--speculative-num-draft-tokens",
            str(s.block_size),
        ]
        for name in TREE_PARAMS:
            if name in m.flags:
                cmd += [m.flags[name], str(getattr(p, name))]
    if s.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(s.mem_fraction_static)]
    if s.context_length is not None:
        cmd += ["--context-length", str(s.context_length)]
    return cmd + list(s.extra_args)
