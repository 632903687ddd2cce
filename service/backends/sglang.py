"""The SGLang launch command for an EngineConfig of kind `sglang` (TP, DFlash, DDTree).

Upstream flags (checked against SGLang 0.5.23's own argument parser in
tests/test_sglang_launcher.py): --model-path, --tp-size, --speculative-algorithm,
--speculative-draft-model-path, --speculative-num-draft-tokens,
--speculative-draft-window-size, --enable-metrics, --host, --port. The DDTree budget/topk
flags exist only in forks and are named by `sglang.ddtree_flags` (default
--speculative-ddtree-budget / --speculative-ddtree-topk).

Sampling defaults (temperature, top_p, top_k) are not launch flags: the replica applies
them to each request, so changing them needs no restart. Tree parameters and the window do.
"""

from __future__ import annotations

from ddserve.config.engine import EngineConfig
from ddserve.errors import ConfigError

# Live parameters SGLang needs a restart for; the rest are applied per request.
RESTART_FIELDS = frozenset({"budget", "topk", "window"})


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
    if p.budget > 0 and s.draft_model_path:
        cmd += [
            "--speculative-algorithm",
            s.speculative_algorithm,
            "--speculative-draft-model-path",
            s.draft_model_path,
            "--speculative-num-draft-tokens",
            str(s.block_size),
            "--speculative-draft-window-size",
            str(p.window),
        ]
        for name, flag in sorted(s.ddtree_flags.items()):
            cmd += [flag, str(getattr(p, name))]
    if s.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(s.mem_fraction_static)]
    if s.context_length is not None:
        cmd += ["--context-length", str(s.context_length)]
    return cmd + list(s.extra_args)
