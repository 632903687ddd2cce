"""`ddserve engine` (one builtin engine server) and `ddserve chat` (ask a running server)."""

from __future__ import annotations

import argparse
import os
import sys

from ddserve.api.limits import ServerLimits
from ddserve.config.flags import ENGINE_FLAGS, engine_config_from
from ddserve.errors import ConfigError, EngineUnavailable, error_from_body


def add_parsers(sub) -> None:
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
    limits = ServerLimits()
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=limits.max_body_bytes,
        help=f"largest request body; larger ones get 413 before they are read (default {limits.max_body_bytes})",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=limits.request_timeout_s,
        help=f"seconds one request may take, queueing included; past it 504 (default {limits.request_timeout_s:g}; 0 = none)",
    )
    p.add_argument(
        "--max-requests",
        type=int,
        default=limits.max_requests,
        help=f"generation requests in flight (running + waiting) at most; more get 429 with Retry-After (default {limits.max_requests}; 0 = no limit)",
    )
    p.add_argument("--log-level", default="info")
    c = sub.add_parser(
        "chat", help="send one chat message to a running server and print the answer"
    )
    c.add_argument("message")
    c.add_argument("--url", default="http://127.0.0.1:30000")
    c.add_argument("--model", default=None)
    c.add_argument("--max-tokens", type=int, default=128)


def run_engine(a: argparse.Namespace) -> None:
    import uvicorn

    from ddserve.api.app import create_app
    from ddserve.backends.local import LocalBackend
    from ddserve.engine.runner import EngineRunner

    config = engine_config_from(
        {flag: getattr(a, flag.lstrip("-").replace("-", "_")) for flag in ENGINE_FLAGS},
        config_path=a.config,
        config_json=a.config_json,
    )
    if config.kind != "builtin":
        raise ConfigError(
            "`ddserve engine` runs the builtin engine; an sglang engine is started by its replica (`ddserve up`) or by SGLang's own launcher"
        )
    if a.max_body_bytes < 1 or a.request_timeout < 0 or a.max_requests < 0:
        raise ConfigError(
            "--max-body-bytes must be >= 1, --request-timeout and --max-requests >= 0 (0 = none)"
        )
    limits = ServerLimits(
        max_body_bytes=a.max_body_bytes,
        request_timeout_s=a.request_timeout or None,
        max_requests=a.max_requests or None,
    )
    runner = EngineRunner(config)
    runner.start()
    app = create_app(LocalBackend(runner), admin_token=a.admin_token, limits=limits)
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
    try:
        if a.model:
            model = a.model
        else:
            r = httpx.get(f"{base}/v1/models", timeout=10)
            if r.status_code != 200:
                raise error_from_body(r.status_code, r.content)
            model = r.json()["data"][0]["id"]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": a.message}],
            "max_tokens": a.max_tokens,
        }
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600)
    except httpx.HTTPError as exc:
        raise EngineUnavailable(f"no server answers at {base}: {type(exc).__name__}") from exc
    if r.status_code != 200:
        raise error_from_body(r.status_code, r.content)
    data = r.json()
    print(data["choices"][0]["message"]["content"])
    dd, u = data.get("ddtree", {}), data["usage"]
    print(
        f"-- {u['completion_tokens']} tokens, accept length {dd.get('accept_length')}, fingerprint {data['system_fingerprint']}",
        file=sys.stderr,
    )


def dispatch(a: argparse.Namespace) -> int:
    if a.command == "engine":
        run_engine(a)
    else:
        run_chat(a)
    return 0
