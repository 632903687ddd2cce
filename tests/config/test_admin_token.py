"""One admin-token rule for `ddserve engine`, `ddserve up` and `ddserve reconfig`: from the
variable `admin_token_env` names or its `_FILE` twin, never argv, never empty."""

import os
import subprocess
import sys

import pytest

from ddserve.config.admin_token import read_admin_token
from ddserve.config.deploy import ServeConfig
from ddserve.config.engine import validate
from ddserve.errors import ConfigError


def test_token_from_the_variable_or_its_file(tmp_path):
    assert read_admin_token(environ={}) is None
    assert read_admin_token(environ={"DDSERVE_ADMIN_TOKEN": "abc"}) == "abc"
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert read_admin_token(environ={"DDSERVE_ADMIN_TOKEN_FILE": str(f)}) == "from-file"
    assert read_admin_token("MY_TOKEN", environ={"MY_TOKEN_FILE": str(f)}) == "from-file"
    assert read_admin_token(file=f, environ={"DDSERVE_ADMIN_TOKEN": "abc"}) == "from-file"


@pytest.mark.parametrize(
    "environ,needle",
    [
        ({"DDSERVE_ADMIN_TOKEN": ""}, "DDSERVE_ADMIN_TOKEN is set but the admin token is empty"),
        ({"DDSERVE_ADMIN_TOKEN": "  "}, "is set but the admin token is empty"),
        ({"DDSERVE_ADMIN_TOKEN": "a b"}, "must not contain whitespace"),
        ({"DDSERVE_ADMIN_TOKEN_FILE": "/nonexistent/t"}, "cannot read the admin token file"),
        ({"DDSERVE_ADMIN_TOKEN": "a", "DDSERVE_ADMIN_TOKEN_FILE": "/t"}, "set one of them"),
    ],
)
def test_bad_tokens_are_refused(environ, needle):
    with pytest.raises(ConfigError, match=needle):
        read_admin_token(environ=environ)


def test_an_empty_token_file_is_refused(tmp_path):
    f = tmp_path / "token"
    f.write_text("\n")
    with pytest.raises(ConfigError, match="DDSERVE_ADMIN_TOKEN_FILE is set but .* empty"):
        read_admin_token(environ={"DDSERVE_ADMIN_TOKEN_FILE": str(f)})


def test_deploy_config_reads_the_variable_it_names(monkeypatch):
    cfg = ServeConfig(admin_token_env="MY_TOKEN")
    monkeypatch.setenv("DDSERVE_ADMIN_TOKEN", "not-this-one")
    monkeypatch.setenv("MY_TOKEN", "mine")
    assert cfg.admin_token == "mine"
    monkeypatch.setenv("MY_TOKEN", "")
    with pytest.raises(ConfigError, match="MY_TOKEN is set but"):
        cfg.admin_token  # noqa: B018
    with pytest.raises(ConfigError, match="admin_token_env"):
        validate(ServeConfig, {"admin_token_env": "BAD NAME"})


def _ddserve(*args, env):
    base = {k: v for k, v in os.environ.items() if not k.startswith("DDSERVE_ADMIN_TOKEN")}
    return subprocess.run(
        [sys.executable, "-m", "ddserve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **env},
    )


def _one_error_line(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("ddserve: error:"), (
        r.stderr
    )
    return lines[0]


def test_engine_refuses_an_empty_token_and_a_token_on_argv():
    line = _one_error_line(_ddserve("engine", "--port", "1", env={"DDSERVE_ADMIN_TOKEN": ""}))
    assert "DDSERVE_ADMIN_TOKEN is set but the admin token is empty" in line
    line = _one_error_line(_ddserve("engine", "--port", "1", "--admin-token", "x", env={}))
    assert "--admin-token-file" in line


def test_reconfig_uses_the_deployment_s_token_variable(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("admin_token_env: MY_TOKEN\n")
    r = _ddserve(
        "reconfig",
        "set",
        "budget=3",
        "--target",
        "engine",
        "--url",
        "http://127.0.0.1:1",
        "--env-file",
        str(tmp_path / "e.env"),
        "--config",
        str(cfg),
        env={"MY_TOKEN": "", "DDSERVE_STATE_DIR": str(tmp_path / "state")},
    )
    assert "MY_TOKEN is set but the admin token is empty" in _one_error_line(r)
