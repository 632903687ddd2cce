"""Render systemd units from a ddserve config.

  ddserve-ray-head.service      Ray head node (`ray start --head --block`)
  ddserve-ray-worker.service    a Ray worker node joining DDSERVE_RAY_HEAD (from its env file)
  ddserve-app.service           deploys/updates the Serve application once the head is up;
                                `systemctl reload` re-applies the config
  ddserve-engine@.service       one standalone builtin engine per instance NAME, configured by
                                /etc/ddserve/engine-NAME.env (one DDSERVE_* variable per engine
                                field, ddserve.config.envfile; the admin token may sit there too):
                                the single-box deployment `ddserve reconfig --target engine` drives

Hardening (measured with `systemd-analyze security --offline=true`, see README): dynamic
users, read-only system, private /tmp, no new privileges, no capabilities, kernel and
control-group protection, native syscalls of @system-service minus @privileged (denied with
EPERM rather than a kill: torch probes optional calls), device access closed except the
NVIDIA device nodes a GPU engine needs (`DeviceAllow=`). Left off on purpose:
MemoryDenyWriteExecute (CUDA and torch JIT need writable+executable memory), PrivateDevices
(it would hide /dev/nvidia*) and ProcSubset=pid (torch reads /proc/cpuinfo).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ddserve.config.deploy import ServeConfig
from ddserve.config.engine import EngineConfig
from ddserve.config.envfile import env_file_text
from ddserve.errors import ConfigError

GPU_DEVICES = [
    "/dev/nvidiactl rw",
    "/dev/nvidia-uvm rw",
    "/dev/nvidia-uvm-tools rw",
    "/dev/nvidia-modeset rw",
    "char-nvidia-frontend rw",
    "char-nvidia-caps rw",
]


@dataclass(frozen=True)
class UnitOptions:
    python: str = sys.executable
    workdir: str = str(Path(__file__).resolve().parents[1])
    config_path: str = "/etc/ddserve/ddserve.yaml"
    env_dir: str = "/etc/ddserve"
    ray_port: int = 6379
    stop_timeout_s: int = 120
    restart_sec: int = 2
    gpu: bool = False

    def check(self) -> None:
        for name in ("python", "workdir", "config_path", "env_dir"):
            value = getattr(self, name)
            if not os.path.isabs(value):
                raise ConfigError(f"{name}={value!r}: must be an absolute path")
            if any(c.isspace() for c in value) or any(c in value for c in "\"'\\$%;"):
                raise ConfigError(
                    f"{name}={value!r}: a path in a unit must not contain spaces, quotes, '$', '%', ';' or backslashes"
                )
        if self.workdir.startswith(("/tmp/", "/var/tmp/")):
            raise ConfigError(
                f"workdir={self.workdir!r}: the units use PrivateTmp, which hides /tmp; install the code elsewhere (e.g. /opt/ddserve)"
            )
        if self.stop_timeout_s <= 0:
            raise ConfigError(
                f"stop_timeout_s={self.stop_timeout_s}: must be a positive number of seconds"
            )
        if self.restart_sec < 0:
            raise ConfigError(f"restart_sec={self.restart_sec}: must be >= 0")


def _hardening(opts: UnitOptions) -> str:
    # the interpreter or the code under /root or /home must stay readable
    home = (
        "read-only"
        if any(p.startswith(("/root", "/home")) for p in (opts.python, opts.workdir))
        else "yes"
    )
    lines = [
        "DynamicUser=yes",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        f"ProtectHome={home}",
        "PrivateTmp=yes",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "ProtectProc=invisible",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "RemoveIPC=yes",
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        "SystemCallArchitectures=native",
        "SystemCallFilter=@system-service",
        "SystemCallFilter=~@privileged",
        "SystemCallErrorNumber=EPERM",
        "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK",
        "UMask=0077",
        "DevicePolicy=closed",
    ]
    if opts.gpu:
        lines += [f"DeviceAllow={d}" for d in GPU_DEVICES]
    return "\n".join(lines)


RAY_ENV = "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING=0 RAY_USAGE_STATS_ENABLED=0"


def _common_service(opts: UnitOptions) -> str:
    return f"""WorkingDirectory={opts.workdir}
Environment=HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 DDSERVE_CACHE=/var/cache/ddserve HF_HOME=/var/cache/ddserve/hf
Environment=TORCHINDUCTOR_CACHE_DIR=/var/cache/ddserve/inductor TRITON_CACHE_DIR=/var/cache/ddserve/triton
CacheDirectory=ddserve
StateDirectory=ddserve
Restart=on-failure
RestartSec={opts.restart_sec}
TimeoutStopSec={opts.stop_timeout_s}
KillMode=mixed
StandardOutput=journal
StandardError=journal
{_hardening(opts)}"""


def _daemon_unit(opts: UnitOptions, unit: str, service: str) -> str:
    """A long-running service: after the network, restart-limited, hardened, enabled at boot."""
    return f"""[Unit]
{unit}
After=network-online.target
Wants=network-online.target
StartLimitIntervalSec=300
StartLimitBurst=5

[Service]
Type=exec
{service}
{_common_service(opts)}

[Install]
WantedBy=multi-user.target
"""


def engine_unit(opts: UnitOptions) -> str:
    return _daemon_unit(
        opts,
        f"Description=ddserve builtin DDTree engine %i\nDocumentation=file://{opts.workdir}/README.md",
        f"EnvironmentFile={opts.env_dir}/engine-%i.env\n"
        f"ExecStart={opts.python} -m ddserve engine --host ${{DDSERVE_HOST}} --port ${{DDSERVE_PORT}}",
    )


def _ray_unit(opts: UnitOptions, description: str, start_args: str, env_file: str = "") -> str:
    """A Ray node kept in the foreground (`ray start --block`) and stopped with `ray stop`."""
    ray = shlex.quote(str(Path(opts.python).with_name("ray")))
    return _daemon_unit(
        opts,
        f"Description={description}",
        env_file + f"Environment={RAY_ENV}\n"
        f"ExecStart={ray} start {start_args} --temp-dir=/var/lib/ddserve/ray\n"
        f"ExecStop={ray} stop",
    )


def ray_head_unit(opts: UnitOptions, cfg: ServeConfig) -> str:
    cpus = max(1, int(cfg.cpus_per_replica))
    return _ray_unit(
        opts,
        "ddserve Ray head node",
        f"--head --block --port {opts.ray_port} --num-cpus {cpus}",
    )


def ray_worker_unit(opts: UnitOptions) -> str:
    return _ray_unit(
        opts,
        "ddserve Ray worker node (joins DDSERVE_RAY_HEAD)",
        "--block --address ${DDSERVE_RAY_HEAD}",
        env_file=f"EnvironmentFile={opts.env_dir}/ray-worker.env\n",
    )


def app_unit(opts: UnitOptions) -> str:
    return f"""[Unit]
Description=ddserve Serve application (deploys once the Ray head is up; reload re-applies)
Requires=ddserve-ray-head.service
After=ddserve-ray-head.service

[Service]
Type=oneshot
RemainAfterExit=yes
Environment=DDSERVE_RAY_LOOPBACK=0
ExecStart={opts.python} -m ddserve up --config {opts.config_path} --address 127.0.0.1:{opts.ray_port}
ExecReload={opts.python} -m ddserve up --config {opts.config_path} --address 127.0.0.1:{opts.ray_port}
ExecStop={opts.python} -m ddserve down --config {opts.config_path} --address 127.0.0.1:{opts.ray_port}
TimeoutStartSec=1800
WorkingDirectory={opts.workdir}
Environment=HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
StandardOutput=journal
StandardError=journal
{_hardening(opts)}

[Install]
WantedBy=multi-user.target
"""


def engine_env(engine: EngineConfig, host: str, port: int) -> str:
    if engine.kind != "builtin":
        raise ConfigError(
            "ddserve-engine@ runs the builtin engine; SGLang engines run under the Ray application"
        )
    return env_file_text(
        engine,
        "for ddserve-engine@",
        keep=[
            f"DDSERVE_HOST={host}",
            f"DDSERVE_PORT={port}",
            "# the admin token for POST /admin/params: DDSERVE_ADMIN_TOKEN=... here (this file",
            "# is 0600 and ddserve reconfig keeps lines it does not own)",
        ],
    )


def render(
    cfg: ServeConfig, opts: UnitOptions, *, engine_name: str = "default", engine_port: int = 30000
) -> dict[str, str]:
    """{relative path: text}: units under units/, environment files under env/."""
    opts.check()
    if not engine_name.replace("-", "").replace("_", "").isalnum():
        raise ConfigError(f"engine_name={engine_name!r}: letters, digits, '-' and '_' only")
    return {
        "units/ddserve-engine@.service": engine_unit(opts),
        "units/ddserve-ray-head.service": ray_head_unit(opts, cfg),
        "units/ddserve-ray-worker.service": ray_worker_unit(opts),
        "units/ddserve-app.service": app_unit(opts),
        f"env/engine-{engine_name}.env": engine_env(cfg.engine, "127.0.0.1", engine_port),
        "env/ray-worker.env": f"DDSERVE_RAY_HEAD=127.0.0.1:{opts.ray_port}\n",
    }


def write_tree(files: dict[str, str], out: Path) -> None:
    """Write everything into a temp dir, then move it in place: nothing half-written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ddserve-units-", dir=out.parent))
    try:
        for rel, text in files.items():
            p = tmp / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
