"""`ddserve systemd render|install|uninstall|status|logs`."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

from ddserve.cli.client import client_api_key, post_json
from ddserve.cli.engine import port_number
from ddserve.config import api_key
from ddserve.config.envfile import read_env_file
from ddserve.errors import ConfigError, DDServeError, SupervisorError
from ddserve.systemd.units import UnitOptions, render, write_tree

UNIT_DIR = "etc/systemd/system"


def add_parsers(sub, default_config: str) -> None:
    s = sub.add_parser("systemd", help="render, install and check systemd units")
    ss = s.add_subparsers(dest="systemd_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=default_config)
    common.add_argument(
        "--engine-name", default="default", help="instance NAME of ddserve-engine@NAME"
    )
    common.add_argument("--engine-port", type=port_number, default=30000)
    common.add_argument(
        "--root", default="/", help="install under this root (for images and tests)"
    )
    common.add_argument(
        "--workdir",
        default=UnitOptions.workdir,
        help="where the ddserve code lives (not under /tmp: the units use PrivateTmp)",
    )
    common.add_argument(
        "--python", default=UnitOptions.python, help="the interpreter that has ddserve installed"
    )
    r = ss.add_parser("render", parents=[common], help="write units and env files into --out")
    r.add_argument("--out", required=True)
    r.add_argument("--gpu", action="store_true", help="allow the NVIDIA device nodes")
    r.add_argument("--stop-timeout", type=int, default=120)
    i = ss.add_parser(
        "install", parents=[common], help="install units + env files, daemon-reload, enable"
    )
    i.add_argument("--gpu", action="store_true")
    i.add_argument("--stop-timeout", type=int, default=120)
    i.add_argument("--start", action="store_true", help="also start ddserve-engine@NAME now")
    i.add_argument(
        "--force-env",
        action="store_true",
        help="overwrite an existing engine env file (reconfig writes it)",
    )
    ss.add_parser("uninstall", parents=[common], help="stop, disable and remove the units")
    ss.add_parser(
        "status",
        parents=[common],
        help="unit states and the engine's real readiness (a real generation)",
    )
    lg = ss.add_parser("logs", parents=[common], help="the engine unit's journal")
    lg.add_argument("-n", type=int, default=50)


def _engine_api_key(env_file: Path) -> dict[str, str]:
    """The key for the engine's API: this shell's DDSERVE_API_KEY, else the one its
    EnvironmentFile gives the engine (readable by root)."""
    headers = client_api_key()
    if headers:
        return headers
    try:
        environ = read_env_file(env_file)
    except OSError:
        return {}
    return api_key.bearer(api_key.read_api_key(environ=environ))


def _systemctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemctl", *args], capture_output=True, text=True)


def dispatch(a) -> int:
    from ddserve.config.deploy import load_config

    cfg = load_config(a.config)
    unit = f"ddserve-engine@{a.engine_name}.service"
    cmd = a.systemd_command
    if cmd in ("render", "install"):
        opts = UnitOptions(
            config_path=str(Path(a.root, "etc/ddserve/ddserve.yaml"))
            if a.root != "/"
            else "/etc/ddserve/ddserve.yaml",
            stop_timeout_s=a.stop_timeout,
            gpu=a.gpu,
            workdir=a.workdir,
            python=a.python,
        )
        files = render(cfg, opts, engine_name=a.engine_name, engine_port=a.engine_port)
        if cmd == "render":
            write_tree(files, Path(a.out))
            print(f"wrote {len(files)} files under {a.out}")
            return 0
        root = Path(a.root)
        unit_dir, env_dir = root / UNIT_DIR, root / "etc/ddserve"
        unit_dir.mkdir(parents=True, exist_ok=True)
        env_dir.mkdir(parents=True, exist_ok=True)
        for rel, text in files.items():
            kind, name = rel.split("/", 1)
            dest = (unit_dir if kind == "units" else env_dir) / name
            if kind == "env" and dest.exists() and not a.force_env:
                print(f"kept {dest} (exists; --force-env overwrites)")
                continue
            tmp = dest.with_name(dest.name + ".tmp")
            tmp.write_text(text)
            if kind == "env":
                tmp.chmod(0o600)  # root (PID 1) reads it; it may hold the admin token
            tmp.replace(dest)
        shutil.copyfile(a.config, env_dir / "ddserve.yaml")
        if a.root == "/":
            for step in (("daemon-reload",), ("enable", unit)):
                r = _systemctl(*step)
                if r.returncode != 0:
                    raise SupervisorError(
                        f"systemctl {' '.join(step)} failed: {r.stderr.strip()[-300:]}"
                    )
            if a.start:
                r = _systemctl("start", unit)
                if r.returncode != 0:
                    raise SupervisorError(
                        f"systemctl start {unit} failed: {r.stderr.strip()[-300:]}"
                    )
        print(f"installed {unit} and the Ray/app units under {root}")
        return 0
    if cmd == "uninstall":
        _systemctl("disable", "--now", unit)
        for name in (
            "ddserve-engine@.service",
            "ddserve-ray-head.service",
            "ddserve-ray-worker.service",
            "ddserve-app.service",
        ):
            (Path(a.root) / UNIT_DIR / name).unlink(missing_ok=True)
        _systemctl("daemon-reload")
        print(f"removed the ddserve units (env files in {Path(a.root) / 'etc/ddserve'} kept)")
        return 0
    if cmd == "status":
        state = _systemctl("is-active", unit).stdout.strip() or "unknown"
        url = f"http://127.0.0.1:{a.engine_port}"
        try:
            body = post_json(
                url + "/generate",
                {"text": "Hello", "sampling_params": {"max_new_tokens": 2}},
                headers=_engine_api_key(
                    Path(a.root) / "etc/ddserve" / f"engine-{a.engine_name}.env"
                ),
                timeout=120,
            )
            ready = f"ready (real generation ok, fingerprint {body.get('system_fingerprint')})"
        except DDServeError as exc:
            ready = f"NOT ready ({exc.message})"
        print(f"{unit}: {state}; {ready}")
        return 0 if state == "active" and ready.startswith("ready") else 1
    if cmd == "logs":
        return subprocess.run(["journalctl", "-u", unit, "-n", str(a.n), "--no-pager"]).returncode
    raise ConfigError(f"unknown systemd command {cmd}")
