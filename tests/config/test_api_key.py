"""The API key follows the admin token's rule (variable, `_FILE`, `--api-key-file`, never
argv, never empty), for `ddserve engine` and for a deployment's replicas (`api_key_env`)."""

import os
import subprocess
import sys

import pytest

from ddserve.backends.process import EngineProcess
from ddserve.config.api_key import read_api_key
from ddserve.config.deploy import ServeConfig
from ddserve.config.engine import validate
from ddserve.errors import ConfigError


def test_key_from_the_variable_or_its_file(tmp_path):
    assert read_api_key(environ={}) is None
    assert read_api_key(environ={"DDSERVE_API_KEY": "k1"}) == "k1"
    f = tmp_path / "key"
    f.write_text("k2\n")
    assert read_api_key(environ={"DDSERVE_API_KEY_FILE": str(f)}) == "k2"
    assert read_api_key(file=f, environ={"DDSERVE_API_KEY": "k1"}) == "k2"
    with pytest.raises(ConfigError, match="DDSERVE_API_KEY is set but the API key is empty"):
        read_api_key(environ={"DDSERVE_API_KEY": " "})
    with pytest.raises(ConfigError, match="--api-key-file=/nonexistent: cannot read the API key"):
        read_api_key(file="/nonexistent", environ={})


def test_deployment_reads_the_variable_it_names(monkeypatch):
    monkeypatch.setenv("DDSERVE_API_KEY", "not-this-one")
    monkeypatch.setenv("MY_KEY", "mine")
    assert ServeConfig(api_key_env="MY_KEY").api_key == "mine"
    assert ServeConfig().api_key == "not-this-one"
    with pytest.raises(ConfigError, match="api_key_env"):
        validate(ServeConfig, {"api_key_env": "A-B"})


def test_an_engine_child_never_inherits_the_key(monkeypatch, tmp_path):
    """A replica's engine listens on loopback behind the replica, which checks the key; the
    replica's own requests to it carry none, so the child must not require one."""
    monkeypatch.setenv("DDSERVE_API_KEY", "k")
    monkeypatch.setenv("DDSERVE_SERVED_NAME", "legacy-alias")  # an alias variable neither
    out = tmp_path / "env"
    eng = EngineProcess(None, command=["sh", "-c", f"env > {out}"])
    eng.start()
    eng.proc.wait(10)
    names = {line.split("=", 1)[0] for line in out.read_text().splitlines()}
    assert "DDSERVE_API_KEY" not in names and "DDSERVE_SERVED_NAME" not in names


def _ddserve(*args, env):
    base = {k: v for k, v in os.environ.items() if not k.startswith("DDSERVE_API_KEY")}
    return subprocess.run(
        [sys.executable, "-m", "ddserve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **env},
    )


def _one_error_line(r, code=2) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == code and len(lines) == 1 and "error:" in lines[0], r.stderr
    return lines[0]


def test_engine_refuses_a_key_on_argv_and_an_empty_key(tmp_path):
    line = _one_error_line(_ddserve("engine", "--api-key", "sk-1", env={}))
    assert "--api-key puts the key on the command line" in line and "--api-key-file" in line
    assert "sk-1" not in line
    line = _one_error_line(_ddserve("engine", env={"DDSERVE_API_KEY": ""}))
    assert "DDSERVE_API_KEY is set but the API key is empty" in line
    cfg = tmp_path / "c.yaml"
    cfg.write_text("api_key_env: MY_KEY\n")
    line = _one_error_line(_ddserve("engine", "--config", str(cfg), env={"MY_KEY": ""}))
    assert "MY_KEY is set but the API key is empty" in line
