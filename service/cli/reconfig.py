"""`ddserve reconfig set|show|history|rollback|status`."""

from __future__ import annotations

import argparse
import json
import math
import sys

from ddserve.config.deploy import load_config
from ddserve.config.engine import EngineConfig
from ddserve.errors import ConfigError
from ddserve.reconfig.controller import Controller
from ddserve.reconfig.plan import desired_config, parse_assignments
from ddserve.reconfig.targets import TARGETS, check_admin, make_target
from ddserve.serve.registry import ReplicaState, as_record

FIELDS_HELP = "budget, topk, window, temperature, top_p, top_k (live parameters) or any engine field as a dotted path (e.g. drafter.depth)"


def seconds(text: str) -> float:
    """A deadline: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: a deadline is a positive number of seconds")
    return value


def add_parsers(sub, default_config: str) -> None:
    r = sub.add_parser(
        "reconfig",
        help="change the serving config safely: plan, roll out, verify by real generation, roll back on failure",
    )
    rs = r.add_subparsers(dest="reconfig_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config", default=default_config, help="the deploy YAML the application was started from"
    )
    common.add_argument(
        "--target",
        default="ray",
        choices=TARGETS,
        help="ray: the Serve application of --config; engine: one bare engine (--url, --env-file, --unit)",
    )
    common.add_argument("--address", default=None, help="Ray cluster address")
    common.add_argument(
        "--url", default="http://127.0.0.1:30000", help="engine target: the engine's address"
    )
    common.add_argument(
        "--env-file",
        default=None,
        help="engine target: the unit's EnvironmentFile (default: /etc/ddserve/engine-NAME.env of --unit ddserve-engine@NAME)",
    )
    common.add_argument(
        "--unit",
        default="ddserve-engine@default.service",
        help="engine target: the systemd unit to restart",
    )
    common.add_argument(
        "--state-dir",
        default=None,
        help="engine target: where its history and deployed config live (default: next to --env-file; "
        "the Ray target keeps them in the cluster)",
    )
    s = rs.add_parser("set", parents=[common], help=f"FIELD=VALUE ...: {FIELDS_HELP}")
    s.add_argument("assignments", nargs="+", metavar="FIELD=VALUE")
    s.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    s.add_argument(
        "--deadline",
        type=seconds,
        default=300.0,
        help="seconds for the rollout to verify before it is rolled back",
    )
    rs.add_parser("show", parents=[common], help="the config in force")
    h = rs.add_parser("history", parents=[common], help="every attempt")
    h.add_argument("--json", action="store_true")
    rb = rs.add_parser(
        "rollback",
        parents=[common],
        help="re-apply the config in force before attempt ID (default: the last success)",
    )
    rb.add_argument("id", nargs="?")
    rb.add_argument("--deadline", type=seconds, default=300.0)
    rs.add_parser(
        "status",
        parents=[common],
        help="config in force, replicas and their fingerprints, last attempt",
    )


def _target(a):
    cfg = load_config(a.config)
    target, history = make_target(
        a.target,
        cfg,
        address=a.address,
        url=a.url,
        env_file=a.env_file,
        unit=a.unit,
        state_dir=a.state_dir,
    )
    return cfg, target, history


def dispatch(a) -> int:
    cfg_file, target, history = _target(a)
    cmd = a.reconfig_command
    if cmd == "show":
        cfg = target.current_config()
        print(
            json.dumps(
                {"fingerprint": cfg.fingerprint(), "engine": cfg.model_dump(mode="json")}, indent=1
            )
        )
        return 0
    if cmd == "history":
        records = history.records()
        if a.json:
            print(json.dumps(records, indent=1))
            return 0
        print(
            f"{'id':14s} {'started':25s} {'user':10s} {'action':8s} {'plan':8s} {'from':14s} {'to':14s} {'outcome':16s} {'total s':>7s}  error"
        )
        for r in records:
            print(
                f"{r['id']:14s} {r['started']:25s} {r['user']:10s} {r['action']:8s} {r['plan']['strategy']:8s} {r['from_fingerprint']:14s} {r['to_fingerprint']:14s} {r['outcome']:16s} {r.get('total_s', 0):7.1f}  {r.get('error', '')}"
            )
        return 0
    if cmd == "status":
        cfg = target.current_config()
        replicas = [as_record(r) for r in target.observe()]
        records = history.records()
        last = records[-1] if records else None
        print(f"config in force: {cfg.fingerprint()} {json.dumps(cfg.params.model_dump())}")
        running = [r for r in replicas if r.state == ReplicaState.RUNNING]
        for r in replicas:
            if r.state != ReplicaState.RUNNING:
                mark = r.state
            else:
                mark = "ok" if r.fingerprint == cfg.fingerprint() else "MISMATCH"
            print(f"  replica {r.replica:10s} {r.state:11s} {r.fingerprint:14s} {mark}")
        if last:
            print(
                f"last attempt: {last['id']} {last['outcome']} ({last['plan']['strategy']}, {last.get('total_s', 0)}s){' - ' + last['error'] if last.get('error') else ''}"
            )
        mixed = {r.fingerprint for r in running} - {cfg.fingerprint()}
        return 1 if mixed else 0
    controller = Controller(target, history, progress=lambda line: print(line, flush=True))
    if cmd == "set":
        current = target.current_config()
        desired = desired_config(current, parse_assignments(a.assignments))  # validate first
        if not a.dry_run:
            check_admin(target, cfg_file.admin_token, cfg_file.admin_token_env)
        record = controller.apply(current, desired, dry_run=a.dry_run, deadline_s=a.deadline)
    elif cmd == "rollback":
        check_admin(target, cfg_file.admin_token, cfg_file.admin_token_env)
        records = history.records()
        if not records:
            raise ConfigError("no reconfiguration recorded yet")
        src = (
            history.get(a.id)
            if a.id
            else next((r for r in reversed(records) if r["outcome"] == "succeeded"), None)
        )
        if src is None:
            raise ConfigError("no successful reconfiguration to roll back")
        record = controller.apply(
            target.current_config(),
            EngineConfig.model_validate(src["from"]),
            deadline_s=a.deadline,
            action=f"rollback:{src['id']}",
        )
    else:
        raise ConfigError(f"unknown reconfig command {cmd}")
    return _report(record)


def _report(record: dict) -> int:
    outcome = record.get("outcome")
    if outcome in ("dry-run", "unchanged"):
        return 0
    if outcome == "succeeded":
        print(
            f"{record['id']}: succeeded in {record['total_s']:.1f}s; now serving {record['to_fingerprint']}"
        )
        return 0
    if outcome == "refused":  # another attempt was under way: nothing was touched
        print(f"ddserve: error: {record['id']} refused: {record['error']}", file=sys.stderr)
        return 1
    print(
        f"ddserve: error: {record['id']} {outcome}: {record.get('error')}"
        + (
            f"; rollback failed: {record['rollback_error']}"
            if outcome == "rollback_failed"
            else f"; {record['from_fingerprint']} serves again"
        ),
        file=sys.stderr,
    )
    return 1
