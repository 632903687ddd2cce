"""Connecting to Ray: the running cluster, or a local head started for `ddserve up`; and
stopping that head again (`ddserve down --stop-ray`) without touching any other cluster.

A head that `up` starts runs in a session of its own (`ray start` is its session leader):
every process of that cluster — GCS, raylet, dashboard, agents, workers, the engines the
replicas own — carries that session id, and nothing else does. `up` records it, with the
head's session directory, in <tmp>/ray/ddserve-head.json; `down --stop-ray` signals exactly
those processes (`ray stop` would kill every Ray process on the machine).

Call `connect` before anything imports ray: Ray reads the variables it sets at import."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddserve.errors import EngineUnavailable


def _ray_tmp() -> Path:
    return Path(tempfile.gettempdir()) / "ray"


def head_record_path() -> Path:
    return _ray_tmp() / "ddserve-head.json"


def _answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except (OSError, ValueError):
        return False


def _local_cluster_address() -> str | None:
    """The head `ddserve up` started, else the cluster Ray last recorded on this machine —
    if it still answers (a stale record would make ray.init retry for minutes)."""
    candidates = []
    try:
        candidates.append(json.loads(head_record_path().read_text())["gcs_address"])
    except (OSError, ValueError, KeyError):
        pass
    try:
        candidates.append((_ray_tmp() / "ray_current_cluster").read_text().strip())
    except OSError:
        pass
    return next((a for a in candidates if a and _answers(a)), None)


# Ray 2.60's switches for the HAProxy ingress (read by the Serve controller and proxies the
# head starts: they must be in the head's environment)
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}


def connect(
    address: str | None, *, start: bool, num_cpus: int | None = None, ingress: str = "proxy"
) -> None:
    """Connect to Ray (once per process); with `start`, start a local head when none runs.
    A local cluster binds to loopback unless DDSERVE_RAY_LOOPBACK=0 (a laptop's Ray is not
    a network service). Call it before anything imports ray: Ray reads these variables at
    import. `ingress="haproxy"`: a head started here serves HTTP through Ray's HAProxy
    ingress (a running cluster keeps its own)."""
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        return
    loopback = address is None and os.environ.get("DDSERVE_RAY_LOOPBACK", "1") == "1"
    if loopback:
        # Ray's own switch: this node's IP is 127.0.0.1
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # LLM replicas are compute-bound: Serve's proxies should balance by load, not prefer
    # replicas on their own node (inherited by the head started below)
    os.environ.setdefault("RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING", "0")
    import ray

    if address and "://" not in address and not _answers(address):
        raise EngineUnavailable(f"no Ray cluster answers at {address}")
    found = address or _local_cluster_address()
    if found:
        try:
            ray.init(address=found, logging_level="ERROR", log_to_driver=False)
            return
        except ConnectionError as exc:
            raise EngineUnavailable(f"no Ray cluster at {found}: {exc}") from exc
    if not start:
        raise EngineUnavailable("no Ray cluster runs on this machine; run `ddserve up` first")
    if ingress == "haproxy":
        os.environ.update(HAPROXY_ENV)  # inherited by `ray start` below
    ray.init(address=start_head(num_cpus, loopback), logging_level="ERROR", log_to_driver=False)


def start_head(num_cpus: int | None = None, loopback: bool = True, port: int | None = None) -> str:
    """`ray start --head` in a session of its own; records what it started. Returns the GCS
    address."""
    cmd = ["ray", "start", "--head", "--disable-usage-stats"]
    if loopback:
        cmd += ["--node-ip-address", "127.0.0.1"]
    if num_cpus:
        cmd += ["--num-cpus", str(num_cpus)]
    if port:
        cmd += ["--port", str(port)]
    print("starting a local Ray head ...", flush=True)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    _, err = proc.communicate()
    if proc.returncode != 0:
        last = err.strip().splitlines()[-1] if err.strip() else proc.returncode
        raise EngineUnavailable(f"`ray start` failed: {last}")
    record = _describe_session(proc.pid)
    if record is None:
        raise EngineUnavailable("`ray start` succeeded but its GCS process is not to be found")
    head_record_path().write_text(json.dumps(record))
    return record["gcs_address"]


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat fields after the command name: state ppid pgrp session ... ([] if gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def session_members(sid: int) -> list[int]:
    """The live (not zombie) processes of session `sid`."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            fields = _stat(int(p.name))
            if len(fields) > 3 and fields[3] == str(sid) and fields[0] != "Z":
                out.append(int(p.name))
    return out


def _describe_session(sid: int) -> dict | None:
    """The GCS address and session directory of the cluster whose processes run in `sid`."""
    for pid in session_members(sid):
        args = _cmdline(pid).split()
        if not args or not args[0].endswith("gcs_server"):
            continue
        opts = dict(a.lstrip("-").split("=", 1) for a in args[1:] if "=" in a)
        if "session-dir" in opts and "gcs_server_port" in opts:
            host = opts.get("node-ip-address", "127.0.0.1")
            return {
                "sid": sid,
                "session_dir": opts["session-dir"],
                "gcs_address": f"{host}:{opts['gcs_server_port']}",
                "started": time.time(),
            }
    return None


def stop_started_head(grace_s: float = 10.0) -> str:
    """Stop the head `ddserve up` started on this machine, and only it. Returns what was
    done; raises EngineUnavailable when there is no such head (other clusters are never
    touched)."""
    path = head_record_path()
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EngineUnavailable(
            f"no Ray head started by `ddserve up` is recorded on this machine ({path}); "
            "other clusters are left alone (stop yours with its own tooling)"
        ) from exc
    members = session_members(record["sid"])
    # the session id is only ours while one of its processes belongs to our session dir
    if not any(record["session_dir"] in _cmdline(pid) for pid in members):
        path.unlink(missing_ok=True)
        return f"the Ray head `ddserve up` started ({record['gcs_address']}) had already stopped"
    n = _stop_session(record["sid"], grace_s)
    path.unlink(missing_ok=True)
    current = _ray_tmp() / "ray_current_cluster"
    try:
        if current.read_text().strip() == record["gcs_address"]:
            current.unlink()  # as `ray stop` does: nothing left to connect to there
    except OSError:
        pass
    return f"stopped the Ray head `ddserve up` started ({record['gcs_address']}, {n} processes)"


def _stop_session(sid: int, grace_s: float) -> int:
    """SIGTERM every process of the session, SIGKILL what is left after `grace_s` (a dying
    raylet may still have spawned one); returns how many processes there were."""
    seen: set[int] = set()
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        for pid in session_members(sid):
            seen.add(pid)
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and session_members(sid):
            time.sleep(0.1)
    return len(seen)
