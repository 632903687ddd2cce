"""Connecting to Ray: the running cluster, or a local head started for `ddserve up`.

Call `connect` before anything imports ray: Ray reads the variables it sets at import."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
from pathlib import Path

from ddserve.errors import EngineUnavailable


def _local_cluster_running() -> bool:
    """Whether the cluster Ray last recorded on this machine still answers (a stale record
    would make ray.init retry for minutes)."""
    record = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    try:
        host, _, port = record.read_text().strip().rpartition(":")
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except (OSError, ValueError):
        return False


def connect(address: str | None, *, start: bool, num_cpus: int | None = None) -> None:
    """Connect to Ray; with `start`, start a local head when none runs. A local cluster binds
    to loopback unless DDSERVE_RAY_LOOPBACK=0 (a laptop's Ray is not a network service).
    Call it before anything imports ray: Ray reads these variables at import."""
    loopback = address is None and os.environ.get("DDSERVE_RAY_LOOPBACK", "1") == "1"
    if loopback:
        # Ray's own switch: this node's IP is 127.0.0.1
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # LLM replicas are compute-bound: Serve's proxies should balance by load, not prefer
    # replicas on their own node (inherited by the head started below)
    os.environ.setdefault("RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING", "0")
    import ray

    if address or _local_cluster_running():
        try:
            ray.init(address=address or "auto", logging_level="ERROR", log_to_driver=False)
            return
        except ConnectionError as exc:
            raise EngineUnavailable(
                f"no Ray cluster at {address or 'this machine'}: {exc}"
            ) from exc
    if not start:
        raise EngineUnavailable("no Ray cluster runs on this machine; run `ddserve up` first")
    cmd = ["ray", "start", "--head", "--disable-usage-stats"]
    if loopback:
        cmd += ["--node-ip-address", "127.0.0.1"]
    if num_cpus:
        cmd += ["--num-cpus", str(num_cpus)]
    print("starting a local Ray head ...", flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode
        raise EngineUnavailable(f"`ray start` failed: {last}")
    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
