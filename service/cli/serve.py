"""`ddserve up | status | down`: the Ray Serve application from the command line."""

from __future__ import annotations

import argparse
import json
import sys
import time

from ddserve.cli.client import request
from ddserve.config import api_key
from ddserve.deploy import DEFAULT_CONFIG
from ddserve.errors import ConfigError, DDServeError, EngineUnavailable
from ddserve.serve.cluster import connect, stop_started_head
from ddserve.serve.registry import ReplicaState, replica_view


def add_parsers(sub) -> None:
    up = sub.add_parser(
        "up", help="start Ray if needed, deploy, wait until a real generation passes"
    )
    up.add_argument("--config", default=DEFAULT_CONFIG)
    up.add_argument(
        "--address",
        default=None,
        help="Ray cluster address (default: the running one, else start a local head)",
    )
    up.add_argument("--num-cpus", type=int, default=None, help="CPUs of a newly started local head")
    st = sub.add_parser("status", help="replicas, their engine, fingerprint and health")
    st.add_argument("--config", default=DEFAULT_CONFIG)
    st.add_argument("--address", default=None)
    st.add_argument("--json", action="store_true")
    down = sub.add_parser(
        "down",
        help="delete the application (and with --stop-ray, the Ray head `up` started here)",
    )
    down.add_argument("--config", default=DEFAULT_CONFIG)
    down.add_argument("--address", default=None)
    down.add_argument(
        "--stop-ray",
        action="store_true",
        help="also stop the local Ray head that `ddserve up` started (never another cluster)",
    )


def run_up(a: argparse.Namespace) -> None:
    from ddserve.config.deploy import load_config

    cfg = load_config(a.config)
    admin_token = cfg.admin_token  # an empty or unreadable token stops here, before deploying
    key = cfg.api_key  # likewise the API key
    connect(a.address, start=True, num_cpus=a.num_cpus, ingress=cfg.http.ingress)  # before ray
    from ray import serve

    from ddserve.serve.replica import build_app

    serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
    t0 = time.time()
    print(
        f"deploying {cfg.name}: {cfg.engine.kind} engine, model {cfg.engine.model_id}, replicas {cfg.replicas} ...",
        flush=True,
    )
    serve.run(build_app(cfg), name=cfg.name, route_prefix="/", blocking=False)
    host = "127.0.0.1" if cfg.http.host in ("0.0.0.0", "::") else cfg.http.host
    url = f"http://{host}:{cfg.http.port}"
    body = {
        "model": cfg.engine.model_id,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
    }
    try:
        r = request(
            "POST",
            url + "/v1/chat/completions",
            json=body,
            headers=api_key.bearer(key),
            timeout=cfg.health.timeout_s,
        )
        data = r.json()
    except (DDServeError, ValueError) as exc:
        raise EngineUnavailable(
            f"deployed, but a real generation failed: {getattr(exc, 'message', exc)}"
        ) from exc
    if not data["choices"][0]["message"]["content"]:
        raise EngineUnavailable("deployed, but a real generation returned no text")
    from ddserve.reconfig.ray_history import RayHistory
    from ddserve.reconfig.ray_target import RayTarget, token_digest

    RayTarget(cfg, RayHistory(cfg.name)).record_deployed(
        cfg, cfg.engine.params.model_dump(), token_digest(admin_token)
    )
    if not admin_token:
        print(
            f"note: {cfg.admin_token_env} is not set, so `ddserve reconfig` will not ask for an admin token"
        )
    print(
        f"ready in {time.time() - t0:.1f}s: {url}/v1 (model {cfg.engine.model_id}, fingerprint {data['system_fingerprint']})"
    )
    print(
        f"  answered: {data['choices'][0]['message']['content']!r} (replica {r.headers.get('x-ddserve-replica')})"
    )
    if key:
        print(f"  the API needs the key in {cfg.api_key_env} (Authorization: Bearer)")


def run_status(a: argparse.Namespace) -> int:
    from ddserve.config.deploy import load_config

    cfg = load_config(a.config)
    connect(a.address, start=False)
    from ray import serve

    apps = serve.status().applications
    app = apps.get(cfg.name)
    if app is None:
        print(f"application {cfg.name!r} is not deployed", file=sys.stderr)
        return 1
    replicas = replica_view(cfg.name, cfg.health.period_s)
    now = time.time()
    if a.json:
        rows = [{**r.to_dict(), "age_s": round(r.age_s(now), 1)} for r in replicas]
        print(
            json.dumps(
                {"application": cfg.name, "status": str(app.status), "replicas": rows}, indent=1
            )
        )
    else:
        print(f"application {cfg.name}: {app.status}")
        for name, dep in app.deployments.items():
            print(f"  deployment {name}: {dep.status} {dict(dep.replica_states)}")
        print(
            f"  {'replica':10s} {'state':10s} {'node':15s} {'engine':8s} {'pid':>7s} {'fingerprint':14s} {'budget':>6s} {'topk':>4s} {'window':>6s} {'temp':>5s} {'checked':>8s}"
        )
        for r in replicas:
            p = r.params
            print(
                f"  {r.replica:10s} {r.state:10s} {r.node:15s} {r.engine:8s} {r.engine_pid or 0:7d} {r.fingerprint:14s} {p.get('budget', ''):>6} {p.get('topk', ''):>4} {p.get('window', ''):>6} {p.get('temperature', ''):>5} {r.age_s(now):>7.1f}s"
            )
    healthy = [r for r in replicas if r.state == ReplicaState.RUNNING]
    return 0 if str(app.status).endswith("RUNNING") and healthy else 1


def run_down(a: argparse.Namespace) -> int:
    from ddserve.config.deploy import load_config

    cfg = load_config(a.config)
    try:
        connect(a.address, start=False)
        import ray
        from ray import serve

        serve.delete(cfg.name)
        print(f"deleted application {cfg.name}")
        ray.shutdown()  # this driver leaves before its cluster goes
    except EngineUnavailable:
        if not a.stop_ray:
            raise
    if a.stop_ray:
        print(stop_started_head())
    return 0


def dispatch(a: argparse.Namespace) -> int:
    if a.command == "up":
        run_up(a)
    elif a.command == "status":
        return run_status(a)
    elif a.command == "down":
        return run_down(a)
    else:
        raise ConfigError(f"unknown command {a.command}")
    return 0
