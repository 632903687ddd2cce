"""Which deployment a reconfiguration drives, and who may drive it.

make_target(kind, cfg, ...)  ->  (RayTarget | EngineTarget, History)
check_admin(target, token)      refuses a change without the deployment's admin token
                                (the token: ServeConfig.admin_token, ddserve.config.admin_token)
"""

from __future__ import annotations

from ddserve.config.deploy import ServeConfig
from ddserve.errors import Unauthorized
from ddserve.reconfig.engine_target import EngineTarget, SystemdSupervisor
from ddserve.reconfig.history import History
from ddserve.reconfig.ray_target import RayTarget, token_digest

TARGETS = ("ray", "engine")


def make_target(
    kind: str,
    cfg: ServeConfig,
    *,
    url: str = "http://127.0.0.1:30000",
    env_file: str | None = None,
    unit: str = "ddserve-engine@default.service",
):
    """`ray`: the Serve application of `cfg`; `engine`: one bare engine at `url` whose unit
    reads `env_file` and restarts through systemd."""
    if kind == "engine":
        env_file = env_file or unit_env_file(unit)
        history = History("engine-" + unit.replace("@", "_").replace("/", "_"))
        target = EngineTarget(
            url, env_file, SystemdSupervisor(unit), history, admin_token=cfg.admin_token
        )
        return target, history
    history = History(f"ray-{cfg.name}")
    return RayTarget(cfg, history), history


def unit_env_file(unit: str) -> str:
    """ddserve-engine@NAME.service reads /etc/ddserve/engine-NAME.env (ddserve.systemd.units)."""
    name = unit.removesuffix(".service").partition("@")[2] or "default"
    return f"/etc/ddserve/engine-{name}.env"


def connect_target(kind: str, address: str | None) -> None:
    """A Ray target needs the driver connected to its cluster; an engine target needs nothing."""
    if kind == "ray":
        from ddserve.serve.cluster import connect

        connect(address, start=False)


def check_admin(target, token: str | None, token_env: str) -> None:
    if getattr(target, "admin_sha", "") and token_digest(token) != target.admin_sha:
        raise Unauthorized(
            f"changing the config needs the admin token the application was deployed with (env {token_env} or {token_env}_FILE)"
        )
