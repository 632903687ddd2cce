"""Which deployment a reconfiguration drives, where its state lives, and who may drive it.

make_target(kind, cfg, ...)  ->  (RayTarget | EngineTarget, HistoryStore)
    ray     the Serve application of `cfg`; its state lives in the cluster (RayHistory), so
            the driver connects to the cluster first (a readable error when it cannot)
    engine  one bare engine; its state lives in the engine's own state directory
            (FileHistory): --state-dir, else $DDSERVE_STATE_DIR/engine-<unit>, else
            <EnvironmentFile's dir>/<its stem>.reconfig/ (next to the file the unit reads)
check_admin(target, token)   refuses a change without the deployment's admin token
"""

from __future__ import annotations

import os
from pathlib import Path

from ddserve.config.deploy import ServeConfig
from ddserve.errors import EngineUnavailable, Unauthorized
from ddserve.reconfig.engine_target import EngineTarget, SystemdSupervisor
from ddserve.reconfig.history import FileHistory
from ddserve.reconfig.ray_history import RayHistory
from ddserve.reconfig.ray_target import RayTarget, token_digest

TARGETS = ("ray", "engine")


def engine_state_dir(env_file: str, unit: str, state_dir: str | None = None) -> Path:
    if state_dir:
        return Path(state_dir)
    if os.environ.get("DDSERVE_STATE_DIR"):
        name = "engine-" + unit.replace("@", "_").replace("/", "_")
        return Path(os.environ["DDSERVE_STATE_DIR"]) / name
    env = Path(env_file)
    return env.parent / f"{env.stem}.reconfig"


def make_target(
    kind: str,
    cfg: ServeConfig,
    *,
    address: str | None = None,
    url: str = "http://127.0.0.1:30000",
    env_file: str | None = None,
    unit: str = "ddserve-engine@default.service",
    state_dir: str | None = None,
):
    """`ray`: the Serve application of `cfg` on the cluster at `address` (default: the
    running one); `engine`: one bare engine at `url` whose unit reads `env_file` and
    restarts through systemd."""
    if kind == "engine":
        env_file = env_file or unit_env_file(unit)
        history = FileHistory(engine_state_dir(env_file, unit, state_dir))
        target = EngineTarget(
            url,
            env_file,
            SystemdSupervisor(unit),
            history,
            admin_token=cfg.admin_token,
            api_key=cfg.api_key,
        )
        return target, history
    from ddserve.serve.cluster import connect

    try:
        connect(address, start=False)
    except EngineUnavailable as exc:
        raise EngineUnavailable(
            f"{exc.message} (application {cfg.name!r}: its deployed config and history live in its cluster)"
        ) from exc
    history = RayHistory(cfg.name)
    return RayTarget(cfg, history), history


def unit_env_file(unit: str) -> str:
    """ddserve-engine@NAME.service reads /etc/ddserve/engine-NAME.env (ddserve.systemd.units)."""
    name = unit.removesuffix(".service").partition("@")[2] or "default"
    return f"/etc/ddserve/engine-{name}.env"


def check_admin(target, token: str | None, token_env: str) -> None:
    if getattr(target, "admin_sha", "") and token_digest(token) != target.admin_sha:
        raise Unauthorized(
            f"changing the config needs the admin token the application was deployed with (env {token_env} or {token_env}_FILE)"
        )
