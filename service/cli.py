"""`ddserve` command line. Bad input exits non-zero with one readable line.

ddserve engine ...        one builtin engine server (FastAPI + uvicorn)
ddserve chat MESSAGE      ask a running server
ddserve up|status|down    the Ray Serve application (service.cli_serve)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from service.errors import ConfigError, DDServeError

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


def _engine_parser(sub) -> None:
    p = sub.add_parser("engine", help="run one builtin DDTree engine server (FastAPI + uvicorn)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--config", default=None, help="a deploy YAML; its `engine:` section is the base config"
    )
    p.add_argument("--config-json", default=None, help=argparse.SUPPRESS)  # used by replicas
    for flag, (_, typ, help_) in ENGINE_FLAGS.items():
        p.add_argument(flag, type=typ, default=None, help=help_)
    p.add_argument(
        "--admin-token",
        default=os.environ.get("DDSERVE_ADMIN_TOKEN"),
        help="required by POST /admin/params (env DDSERVE_ADMIN_TOKEN)",
    )
    p.add_argument("--log-level", default="info")


def engine_config_from_args(a: argparse.Namespace):
    import json

    from service.config import EngineConfig, validate
    from service.errors import ConfigError

    base: dict = {}
    if a.config:
        from service.deploy_config import load_config

        base = load_config(a.config).engine.model_dump()
    elif a.config_json:
        try:
            base = json.loads(a.config_json)
        except ValueError as exc:
            raise ConfigError(f"--config-json is not valid JSON: {exc}") from exc
    for flag, (path, typ, _) in ENGINE_FLAGS.items():
        value = getattr(a, flag.lstrip("-").replace("-", "_"))
        env = os.environ.get(env_name(flag))
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


def run_engine(a: argparse.Namespace) -> None:
    import uvicorn

    from service.engine.runner import EngineRunner
    from service.server.app import create_app
    from service.server.backend import LocalBackend

    config = engine_config_from_args(a)
    if config.kind != "builtin":
        raise ConfigError(
            "`ddserve engine` runs the builtin engine; an sglang engine is started by its replica (`ddserve up`) or by SGLang's own launcher"
        )
    runner = EngineRunner(config)
    runner.start()
    app = create_app(LocalBackend(runner), admin_token=a.admin_token)
    print(
        f"ddserve engine: {config.model_id} on http://{a.host}:{a.port} (fingerprint {runner.fingerprint})",
        flush=True,
    )
    try:
        uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, access_log=False)
    finally:
        runner.shutdown()


def run_chat(a: argparse.Namespace) -> None:
    import httpx

    base = a.url.rstrip("/")
    model = a.model or httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": a.message}],
        "max_tokens": a.max_tokens,
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600)
    data = r.json()
    if r.status_code != 200:
        raise DDServeError(data.get("error", {}).get("message", r.text))
    print(data["choices"][0]["message"]["content"])
    dd, u = data.get("ddtree", {}), data["usage"]
    print(
        f"-- {u['completion_tokens']} tokens, accept length {dd.get('accept_length')}, fingerprint {data['system_fingerprint']}",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ddserve", description="DDTree speculative decoding server"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _engine_parser(sub)
    c = sub.add_parser(
        "chat", help="send one chat message to a running server and print the answer"
    )
    c.add_argument("message")
    c.add_argument("--url", default="http://127.0.0.1:30000")
    c.add_argument("--model", default=None)
    c.add_argument("--max-tokens", type=int, default=128)
    from service import cli_serve

    cli_serve.add_parsers(sub)
    from reconfig import cli as reconfig_cli

    reconfig_cli.add_parsers(sub, cli_serve.DEFAULT_CONFIG)
    from systemd import cli as systemd_cli

    systemd_cli.add_parsers(sub, cli_serve.DEFAULT_CONFIG)
    from bench import cli as bench_cli

    bench_cli.add_parsers(sub)
    a = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(a, "log_level", "warning").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if a.command == "engine":
            run_engine(a)
        elif a.command == "chat":
            run_chat(a)
        elif a.command == "reconfig":
            return reconfig_cli.dispatch(a)
        elif a.command == "systemd":
            return systemd_cli.dispatch(a)
        elif a.command == "bench":
            return bench_cli.dispatch(a)
        else:
            return cli_serve.dispatch(a)
    except DDServeError as exc:
        print(f"ddserve: error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
