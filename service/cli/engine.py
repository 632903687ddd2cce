"""`ddserve engine` (one builtin engine server) and `ddserve chat` (ask a running server)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import os
import socket
import sys

from ddserve.api.limits import ServerLimits
from ddserve.backends.api_processes import event_loop_factory, stop_on_signals
from ddserve.cli.api_server import ApiServer, serve_first
from ddserve.cli.client import client_api_key, get_json, post_json
from ddserve.config import api_key
from ddserve.config.admin_token import DEFAULT_ENV, read_admin_token
from ddserve.config.deploy import load_config
from ddserve.config.engine import EngineConfig
from ddserve.config.flags import ENGINE_FIELDS, encode_value, engine_config_from
from ddserve.errors import ConfigError, EngineUnavailable

METAVAR = {"int": "N", "float": "X", "str": "TEXT", "list": "JSON|A,B", "object": "JSON"}


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (ddserve.config.flags.ENGINE_FIELDS): name, type, help
    and default from the model; each falls back to its DDSERVE_* variable."""
    g = p.add_argument_group(
        "engine config",
        "every flag falls back to its variable (--top-p: DDSERVE_TOP_P), then to --config's "
        "`engine:` section, then to the default",
    )
    for s in ENGINE_FIELDS:
        default = "unset" if s.default is None else encode_value(s, s.default) or '""'
        help_ = f"{s.help} [env {s.env}; default {default}]".replace("%", "%%")
        if s.kind == "bool":
            g.add_argument(s.flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            metavar = "{" + ",".join(s.choices) + "}" if s.choices else METAVAR[s.kind]
            g.add_argument(
                s.flag, *s.aliases, dest=s.dest, default=None, metavar=metavar, help=help_
            )


def port_number(text: str) -> int:
    """An argparse type: a TCP port a server can listen on (1-65535)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: choose 1-65535")
    return port


def seconds(text: str) -> float:
    """An argparse type: a duration in seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a duration: choose 0 or more seconds")
    return value


API_SERVERS_ENV = "DDSERVE_API_SERVER_COUNT"


def api_server_count(text: str) -> int:
    """An argparse type: how many API processes (1 or more)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of processes") from None
    if not 1 <= n <= 64:
        raise argparse.ArgumentTypeError(f"{n} API processes: choose 1-64")
    return n


def api_servers_of(a: argparse.Namespace) -> int:
    """--api-server-count, else its variable, else --config's `api_server_count` (what the
    file's replicas run: `ddserve engine --config deploy/smollm2-gpu.yaml` serves as they
    would), else 1."""
    if a.api_server_count is not None:
        return a.api_server_count
    text = os.environ.get(API_SERVERS_ENV, "").strip()
    if not text:
        return load_config(a.config).api_server_count if a.config else 1
    try:
        return api_server_count(text)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{API_SERVERS_ENV}={text}: {exc}") from None


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening, before anything slow happens: a busy port
    is one line at start-up, not a failure after the weights load. (Connections that arrive
    while the model loads wait in the backlog and are answered once it serves.)"""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: cannot resolve it ({exc.strerror})") from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is fine
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        why = {
            errno.EADDRINUSE: "the port is in use (another server there? choose another --port)",
            errno.EACCES: "permission denied (ports below 1024 need privileges)",
            errno.EADDRNOTAVAIL: "this machine has no such address (--host)",
        }.get(exc.errno, exc.strerror)
        raise ConfigError(f"cannot listen on {host}:{port}: {why}") from exc
    return sock


def add_parsers(sub) -> None:
    p = sub.add_parser("engine", help="run one builtin DDTree engine server (FastAPI + uvicorn)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port",
        type=port_number,
        default=30000,
        help="port to listen on, 1-65535; bound before the model loads (default 30000)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="a deploy YAML: its `engine:` section is the base config, its admin_token_env names the token's variable",
    )
    add_engine_flags(p)
    p.add_argument(
        "--admin-token-file",
        default=None,
        metavar="PATH",
        help=f"file holding the token POST /admin/params requires (else env {DEFAULT_ENV} or {DEFAULT_ENV}_FILE)",
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
    p.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="log one line per HTTP request (logger ddserve.access) [env DDSERVE_ACCESS_LOG=1; default off]",
    )
    p.add_argument(
        "--stats-interval",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="seconds between stats lines (running, waiting, tok/s, tau) while there is work; 0 = off [env DDSERVE_STATS_INTERVAL; default 10]",
    )
    p.add_argument(
        "--api-server-count",
        type=api_server_count,
        default=None,
        metavar="N",
        help=f"API processes (HTTP, JSON, detokenisation) over the one engine core, sharing the port, as vLLM's flag: more keep first tokens prompt at high concurrency; --max-requests is shared out among them [env {API_SERVERS_ENV}; default: --config's api_server_count, else 1]",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help=f"file holding the key /v1/* and /generate require as `Authorization: Bearer` (else env {api_key.DEFAULT_ENV} or {api_key.DEFAULT_ENV}_FILE; unset = no key; --api-key VALUE is refused: argv is public)",
    )
    p.add_argument("--admin-token", default=None, help=argparse.SUPPRESS)  # refused: see below
    p.add_argument("--api-key", default=None, help=argparse.SUPPRESS)  # refused likewise
    p.add_argument("--log-level", default="info")
    c = sub.add_parser(
        "chat",
        help=f"send one chat message to a running server and print the answer (the key from env {api_key.DEFAULT_ENV})",
    )
    c.add_argument("message")
    c.add_argument("--url", default="http://127.0.0.1:30000")
    c.add_argument("--model", default=None)
    c.add_argument("--max-tokens", type=int, default=128)


def engine_config_of(a: argparse.Namespace) -> EngineConfig:
    """The config `ddserve engine` serves with: its flags, variables and --config file."""
    return engine_config_from(
        {s.flag: getattr(a, s.dest) for s in ENGINE_FIELDS}, config_path=a.config
    )


def admin_token_of(a: argparse.Namespace) -> str | None:
    if a.admin_token is not None:
        raise ConfigError(
            f"--admin-token puts the token on the command line, where every user of the machine can read it; set env {DEFAULT_ENV}, {DEFAULT_ENV}_FILE or --admin-token-file PATH"
        )
    var = load_config(a.config).admin_token_env if a.config else DEFAULT_ENV
    return read_admin_token(var, file=a.admin_token_file)


def api_key_of(a: argparse.Namespace) -> str | None:
    """The key the inference API requires: ddserve.config.api_key's rule (never argv)."""
    if a.api_key is not None:
        raise ConfigError(api_key.argv_refused())
    var = load_config(a.config).api_key_env if a.config else api_key.DEFAULT_ENV
    return api_key.read_api_key(var, file=a.api_key_file)


def run_engine(a: argparse.Namespace) -> None:
    admin_token = admin_token_of(a)  # bad input stops here, before torch is imported
    key = api_key_of(a)
    config = engine_config_of(a)
    if config.kind != "builtin":
        raise ConfigError(
            "`ddserve engine` runs the builtin engine; an sglang engine is started by its replica (`ddserve up`) or by SGLang's own launcher"
        )
    if a.max_body_bytes < 1 or a.request_timeout < 0 or a.max_requests < 0:
        raise ConfigError(
            "--max-body-bytes must be >= 1, --request-timeout and --max-requests >= 0 (0 = none)"
        )

    count = api_servers_of(a)

    sock = listen_socket(a.host, a.port)  # a busy port fails here, before the weights load

    limits = ServerLimits(
        max_body_bytes=a.max_body_bytes,
        request_timeout_s=a.request_timeout or None,
        max_requests=a.max_requests or None,
    )
    spec = ApiServer(
        host=a.host,
        port=a.port,
        log_level=a.log_level,
        access_log=a.access_log,  # None: env DDSERVE_ACCESS_LOG
        stats_interval_s=a.stats_interval,  # None: env DDSERVE_STATS_INTERVAL, else 10
        admin_token=admin_token,
        api_key=key,
        limits=dataclasses.asdict(limits),
        count=count,
    )
    stop_on_signals()
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            code = runner.run(serve_first(spec, config, sock))
    finally:
        sock.close()
    if code:
        raise EngineUnavailable(
            "the engine core or an API process exited; the server stopped (see the log above)"
        )


def run_chat(a: argparse.Namespace) -> None:
    base = a.url.rstrip("/")
    headers = client_api_key()
    model = a.model or get_json(f"{base}/v1/models", headers=headers)["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": a.message}],
        "max_tokens": a.max_tokens,
    }
    data = post_json(f"{base}/v1/chat/completions", body, headers=headers, timeout=600)
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
