"""`ddserve down --stop-ray` stops the processes of the head `up` started and nothing else.

Real processes stand in for two Ray clusters (a Ray head takes ~15 s to start on this
machine): each cluster is a session of its own, as `ray start` run in a new session makes
it; one member names the session directory (as gcs_server and raylet do), others do not
(workers retitle themselves, engines set their own process group)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddserve.errors import EngineUnavailable
from ddserve.serve import cluster

CHILDREN = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], preexec_fn=os.setpgrp)
time.sleep(300)
"""


def fake_cluster(session_dir: str) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", CHILDREN, f"--session-dir={session_dir}"], start_new_session=True
    )
    deadline = time.time() + 20
    while len(cluster.session_members(p.pid)) < 3 and time.time() < deadline:
        time.sleep(0.1)
    assert len(cluster.session_members(p.pid)) == 3
    return p


@pytest.fixture()
def record_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "_ray_tmp", lambda: tmp_path)
    return tmp_path


def test_stop_kills_only_the_recorded_session(record_dir):
    ours = fake_cluster("/tmp/ray/session_ours_1")
    other = fake_cluster("/tmp/ray/session_other_2")
    try:
        cluster.head_record_path().write_text(
            json.dumps(
                {"sid": ours.pid, "session_dir": "/tmp/ray/session_ours_1", "gcs_address": "x:1"}
            )
        )
        (record_dir / "ray_current_cluster").write_text("x:1")
        msg = cluster.stop_started_head(grace_s=5)
        assert "stopped" in msg and "3 processes" in msg
        ours.wait(10)
        assert cluster.session_members(ours.pid) == []
        assert len(cluster.session_members(other.pid)) == 3, "another cluster must survive"
        assert not cluster.head_record_path().exists()
        assert not (record_dir / "ray_current_cluster").exists()
    finally:
        for p in (ours, other):
            for pid in cluster.session_members(p.pid):
                os.kill(pid, 9)


def test_a_stale_record_kills_nothing(record_dir):
    other = fake_cluster("/tmp/ray/session_other_3")
    try:
        # the recorded session id now names a session of another cluster: not ours
        cluster.head_record_path().write_text(
            json.dumps(
                {"sid": other.pid, "session_dir": "/tmp/ray/session_gone", "gcs_address": "x:1"}
            )
        )
        assert "already stopped" in cluster.stop_started_head(grace_s=1)
        assert len(cluster.session_members(other.pid)) == 3
    finally:
        for pid in cluster.session_members(other.pid):
            os.kill(pid, 9)


def test_without_a_record_nothing_is_stopped(record_dir):
    with pytest.raises(EngineUnavailable, match="other clusters are left alone"):
        cluster.stop_started_head()


@pytest.mark.slow
def test_real_heads_only_the_one_up_started_is_stopped(record_dir):
    """Two real Ray heads on this machine (~45 s): `down --stop-ray`'s stop takes ours down
    and the other keeps running tasks."""
    from tests.api.conftest import free_port

    current = Path("/tmp/ray/ray_current_cluster")
    saved = current.read_text() if current.exists() else None
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    other_port = free_port()
    other = subprocess.Popen(
        ["ray", "start", "--head", "--disable-usage-stats", "--node-ip-address", "127.0.0.1"]
        + ["--num-cpus", "1", "--port", str(other_port), "--include-dashboard", "false"]
        + ["--ray-client-server-port", str(free_port())]
        + ["--dashboard-agent-listen-port", str(free_port())],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert other.wait(120) == 0, other.stderr.read()
    try:
        addr = cluster.start_head(num_cpus=1, port=free_port())
        ours = json.loads(cluster.head_record_path().read_text())
        assert addr == ours["gcs_address"] and len(cluster.session_members(ours["sid"])) > 3
        msg = cluster.stop_started_head()
        assert "stopped" in msg
        assert cluster.session_members(ours["sid"]) == [] and not cluster._answers(addr)
        code = "import ray; ray.init(address='127.0.0.1:%d'); print(ray.get(ray.put(7)))"
        r = subprocess.run(
            [sys.executable, "-c", code % other_port], env=env, capture_output=True, text=True
        )
        assert r.stdout.strip() == "7", r.stderr[-500:]
    finally:
        cluster._stop_session(other.pid, 10)
        if saved is not None:
            current.write_text(saved)
