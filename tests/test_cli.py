import importlib.metadata
import os
import socket
import subprocess
import sys

import pytest

from ddserve.backends.process import EngineProcess, free_port
from ddserve.cli import build_parser
from ddserve.cli.engine import engine_config_of


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--budget", "-1"], "params.budget=-1"),
        (["--topk", "0"], "params.topk=0"),
        (["--top-p", "1.5"], "params.top_p=1.5"),
        (["--drafter", "magic"], "drafter.kind='magic'"),
        (["--model", "no-such-model"], "not a readable model"),
    ],
)
def test_bad_engine_arguments_exit_nonzero_with_one_line(args, needle):
    r = subprocess.run(
        [sys.executable, "-m", "ddserve", "engine", "--port", str(free_port()), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ddserve: error:") and needle in lines[0], (
        r.stderr
    )


def ddserve(*args, env=None, timeout=120):
    base = {k: v for k, v in os.environ.items() if not k.startswith("DDSERVE_API_KEY")}
    return subprocess.run(
        [sys.executable, "-m", "ddserve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**base, **(env or {})},
    )


def one_line(r, code: int) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == code and len(lines) == 1 and "error" in lines[0], (
        r.returncode,
        r.stderr,
    )
    return lines[0]


def test_version_is_the_installed_distribution_s():
    r = ddserve("--version")
    assert (
        r.returncode == 0 and r.stdout.strip() == f"ddserve {importlib.metadata.version('ddserve')}"
    )


@pytest.mark.parametrize("port", ["99999", "0", "-1", "http"])
def test_a_port_outside_1_65535_is_refused_in_one_line(port):
    line = one_line(ddserve("engine", "--port", port), 2)
    assert line.startswith("ddserve engine: error: argument --port:") and port in line


def test_a_busy_port_fails_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # an unknown model would fail at load time: the port error must come first
        r = ddserve("engine", "--port", str(port), "--model", "no-such-model")
    line = one_line(r, 2)
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in line


def test_served_model_name_and_its_old_alias():
    parser = build_parser()
    for flag in ("--served-model-name", "--served-name"):
        a = parser.parse_args(["engine", flag, "my-model"])
        assert engine_config_of(a).served_name == "my-model"


def test_access_log_and_stats_interval_flags_fall_back_to_their_variables():
    """Unset, both are None: create_app then reads DDSERVE_ACCESS_LOG / DDSERVE_STATS_INTERVAL
    (served end to end in tests/api: test_a_hugging_face_model_directory_serves_chat...)."""
    parser = build_parser()
    a = parser.parse_args(["engine"])
    assert a.access_log is None and a.stats_interval is None
    a = parser.parse_args(["engine", "--access-log", "--stats-interval", "2.5"])
    assert a.access_log is True and a.stats_interval == 2.5
    assert parser.parse_args(["engine", "--no-access-log"]).access_log is False
    line = one_line(ddserve("engine", "--stats-interval", "-1"), 2)
    assert "argument --stats-interval: -1 is not a duration" in line


def test_clients_of_a_closed_port_fail_in_one_line():
    port = free_port()
    line = one_line(ddserve("chat", "hi", "--url", f"http://127.0.0.1:{port}"), 4)
    assert f"no server answers at http://127.0.0.1:{port}: connection refused" in line
    line = one_line(ddserve("bench", "--url", f"http://127.0.0.1:{port}", "--prompts", "chat"), 4)
    assert "no server answers" in line


@pytest.fixture(scope="module")
def keyed_engine():
    port = free_port()
    eng = EngineProcess(
        None,
        port=port,
        env={"DDSERVE_THREADS": "1", "DDSERVE_API_KEY": "k-cli"},
        command=[sys.executable, "-m", "ddserve", "engine", "--port", str(port)]
        + ["--model", "tiny-random:7", "--max-context", "128", "--served-model-name", "tiny"],
    )
    eng.start()
    try:
        eng.wait_ready(180)  # /health_generate needs no key
        yield eng
    finally:
        eng.stop()


def test_chat_and_bench_send_the_key_and_say_when_it_is_missing(keyed_engine, tmp_path):
    url = keyed_engine.url
    line = one_line(ddserve("chat", "hi", "--url", url), 3)
    assert "HTTP 401" in line and "set DDSERVE_API_KEY" in line
    line = one_line(ddserve("chat", "hi", "--url", url, env={"DDSERVE_API_KEY": "nope"}), 3)
    assert "HTTP 401: wrong API key" in line
    r = ddserve("chat", "hi", "--url", url, "--max-tokens", "2", env={"DDSERVE_API_KEY": "k-cli"})
    assert r.returncode == 0 and "fingerprint" in r.stderr, r.stderr
    line = one_line(ddserve("bench", "--url", url, "--prompts", "chat"), 3)
    assert "/v1/models: HTTP 401" in line
    key_file = tmp_path / "key"
    key_file.write_text("k-cli\n")
    r = ddserve(
        "bench",
        "--url",
        url,
        "--prompts",
        "chat",
        "--concurrency",
        "1",
        "--requests",
        "1",
        "--warmup",
        "0",
        "--max-tokens",
        "2",
        "--no-progress",
        "--out",
        str(tmp_path / "b"),
        env={"DDSERVE_API_KEY_FILE": str(key_file)},
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_systemd_status_reads_the_key_from_the_engine_s_env_file(keyed_engine, tmp_path):
    port = str(keyed_engine.port)
    args = (
        "systemd",
        "status",
        "--engine-name",
        "t",
        "--engine-port",
        port,
        "--root",
        str(tmp_path),
    )
    r = ddserve(*args)
    assert r.returncode == 1 and "NOT ready (" in r.stdout and "HTTP 401" in r.stdout
    assert len(r.stdout.strip().splitlines()) == 1
    env_dir = tmp_path / "etc" / "ddserve"
    env_dir.mkdir(parents=True)
    (env_dir / "engine-t.env").write_text("DDSERVE_API_KEY=k-cli\n")
    r = ddserve(*args)
    assert "ready (real generation ok" in r.stdout and "NOT" not in r.stdout, r.stdout
