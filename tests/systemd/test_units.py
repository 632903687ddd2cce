"""systemd units: rendered, checked by systemd's own tools, and run by a real systemd
manager (the host's root booted as a container with systemd-nspawn; tests/systemd/nspawn.py)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ddserve.config.deploy import load_config
from ddserve.errors import ConfigError
from ddserve.systemd.units import UnitOptions, render, write_tree
from tests.api.conftest import free_port
from tests.systemd import nspawn

ROOT = Path(__file__).parents[2]
ODD_NAME = "tiny 'random' \"model\" $HOME `x` \\y %i #z;=1"
UNITS = [
    "ddserve-engine@t1.service",
    "ddserve-ray-head.service",
    "ddserve-ray-worker.service",
    "ddserve-app.service",
]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("units") / "tree"
    write_tree(
        render(load_config(ROOT / "deploy" / "default.yaml"), UnitOptions(workdir="/opt/ddserve")),
        out,
    )
    flat = out.parent / "flat"
    flat.mkdir()
    for p in (out / "units").iterdir():
        (flat / p.name.replace("@.service", "@t1.service")).write_text(p.read_text())
    return out, flat


def test_systemd_analyze_verify_is_clean(rendered):
    _, flat = rendered
    r = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *[str(flat / u) for u in UNITS]],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr


@pytest.mark.parametrize(
    "unit",
    [
        "ddserve-engine@t1.service",
        "ddserve-app.service",
        "ddserve-ray-head.service",
        "ddserve-ray-worker.service",
    ],
)
def test_exposure_score_is_at_most_3(rendered, unit):
    _, flat = rendered
    r = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--json=short", str(flat / unit)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    r2 = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(flat / unit)],
        capture_output=True,
        text=True,
    )
    score = float(r2.stdout.strip().splitlines()[-1].split(":")[1].split()[0])
    print(f"{unit}: exposure {score}")
    assert score <= 3.0
    assert json.loads(r.stdout)  # machine-readable too


@pytest.mark.parametrize(
    "opts,needle",
    [
        (UnitOptions(workdir="/opt/dd serve"), "must not contain spaces"),
        (UnitOptions(python="python3", workdir="/opt/ddserve"), "must be an absolute path"),
        (UnitOptions(stop_timeout_s=-1, workdir="/opt/ddserve"), "positive number of seconds"),
        (UnitOptions(workdir="/tmp/ddserve"), "PrivateTmp"),
    ],
)
def test_bad_values_fail_and_nothing_is_written(tmp_path, opts, needle):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=needle):
        write_tree(render(load_config(ROOT / "deploy" / "default.yaml"), opts), out)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_cli_render_rejects_a_config_missing_fields(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("engine: {params: {window: -2}}")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddserve",
            "systemd",
            "render",
            "--config",
            str(bad),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    assert (
        r.returncode == 2
        and "engine.params.window=-2" in r.stderr
        and not (tmp_path / "o").exists()
    )


@pytest.mark.slow
@pytest.mark.skipif(
    not nspawn.available(),
    reason="needs root and systemd-nspawn (deploy/install.sh installs systemd-container)",
)
def test_engine_unit_under_a_real_systemd(tmp_path):
    port = free_port()
    cfg = tmp_path / "ddserve.yaml"
    cfg.write_text(
        json.dumps(
            {
                "engine": {
                    "model": "tiny-random:7",
                    "served_name": ODD_NAME,  # quoted in the EnvironmentFile; systemd unquotes it
                    "max_context": 256,
                    "drafter": {"ngram_max": 3},
                    "params": {"budget": 6, "topk": 2},
                }
            }
        )
    )
    url = f"http://127.0.0.1:{port}"
    # the checkout may live under /tmp, which the unit's PrivateTmp hides: mount it at /opt
    src = "/opt/ddserve-src"
    with nspawn.booted([f"{ROOT}:{src}", str(tmp_path)]) as c:
        # the interpreter lives under /root here; /opt or /usr in production
        c.run("chmod", "755", "/root")
        # installed as a user would (not editable): an editable install points at the checkout,
        # which PrivateTmp hides when it lives under /tmp; the container's writes stay in its
        # overlay, the host's environment is untouched
        c.run(
            "sh",
            "-c",
            f"cd {src} && {sys.executable} -m pip install -q --no-deps --no-build-isolation .",
        )
        c.run(
            "sh",
            "-c",
            f"cd {src} && {sys.executable} -m ddserve systemd install --config {cfg} --engine-name t1 --engine-port {port} --start",
        )
        fp1 = _wait_generation(url, 240)
        assert (
            c.run("systemctl", "is-active", "ddserve-engine@t1.service").stdout.strip() == "active"
        )
        # edit the EnvironmentFile and restart: the engine serves the new parameters
        c.run("sed", "-i", "s/^DDSERVE_BUDGET=.*/DDSERVE_BUDGET=3/", "/etc/ddserve/engine-t1.env")
        c.run("systemctl", "restart", "ddserve-engine@t1.service")
        fp2 = _wait_generation(url, 120, not_fp=fp1)
        assert fp2 != fp1
        info = httpx.get(url + "/server_info").json()
        assert info["config"]["params"]["budget"] == 3
        # kill the main process: systemd restarts it (Restart=on-failure)
        pid = c.run(
            "systemctl", "show", "-p", "MainPID", "--value", "ddserve-engine@t1.service"
        ).stdout.strip()
        c.run("kill", "-9", pid)
        time.sleep(1)
        assert _wait_generation(url, 120) == fp2
        assert (
            c.run(
                "systemctl", "show", "-p", "NRestarts", "--value", "ddserve-engine@t1.service"
            ).stdout.strip()
            == "1"
        )
        journal = c.run("journalctl", "-u", "ddserve-engine@t1.service", "--no-pager").stdout
        assert "engine ready" in journal and "ddserve engine" in journal
        st = c.run(
            "sh",
            "-c",
            f"cd {src} && {sys.executable} -m ddserve systemd status --engine-name t1 --engine-port {port} --config {cfg}",
            check=False,
        )
        assert st.returncode == 0 and "ready (real generation ok" in st.stdout
        info = httpx.get(url + "/server_info").json()
        assert info["config"]["served_name"] == ODD_NAME
        assert info["config"]["drafter"]["ngram_max"] == 3
        # a reconfig of a field with no live path: EnvironmentFile rewritten, systemctl restart,
        # verified by a real generation; the admin token line the operator added is kept
        c.run("sh", "-c", "echo DDSERVE_ADMIN_TOKEN=tok >> /etc/ddserve/engine-t1.env")
        rc = c.run(
            "sh",
            "-c",
            f"cd {src} && DDSERVE_ADMIN_TOKEN=tok DDSERVE_STATE_DIR=/var/tmp/ddserve-state {sys.executable} -m ddserve reconfig set drafter.ngram_max=2 --target engine --unit ddserve-engine@t1.service --url {url} --config {cfg} --deadline 240",
            check=False,
            timeout=300,
        )
        assert rc.returncode == 0, rc.stdout + rc.stderr
        info = httpx.get(url + "/server_info").json()
        assert info["config"]["drafter"]["ngram_max"] == 2
        assert info["config"]["served_name"] == ODD_NAME
        assert httpx.post(url + "/admin/params", json={"budget": 3}).status_code == 401


def _wait_generation(url: str, timeout: float, not_fp: str | None = None) -> str:
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            r = httpx.post(
                url + "/generate",
                json={"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                timeout=30,
            )
            if r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] > 0:
                fp = r.json()["system_fingerprint"]
                if fp != not_fp:
                    return fp
            last = r.status_code
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        time.sleep(0.5)
    raise TimeoutError(f"no real generation from {url} within {timeout}s (last: {last})")
