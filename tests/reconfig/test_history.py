"""The file-backed store (a bare engine's state) and where the engine target keeps it."""

import json
import threading
from pathlib import Path

import pytest

from ddserve.config.deploy import ServeConfig
from ddserve.errors import ConfigError
from ddserve.reconfig.history import FileHistory
from ddserve.reconfig.targets import make_target


def test_an_attempt_is_visible_in_progress_then_replaced_by_its_outcome(tmp_path):
    h = FileHistory(tmp_path / "s")
    aid = h.begin({"action": "set", "outcome": "in_progress"})
    assert aid == "r0001" and h.records() == [
        {"id": aid, "action": "set", "outcome": "in_progress"}
    ]
    h.append({"id": aid, "action": "set", "outcome": "succeeded"})
    assert [r["outcome"] for r in h.records()] == ["succeeded"]
    assert h.begin({"outcome": "in_progress"}) == "r0002"
    assert h.get("r0001")["outcome"] == "succeeded"
    with pytest.raises(ConfigError, match="r0009"):
        h.get("r0009")


def test_concurrent_controllers_never_share_an_attempt_id(tmp_path):
    ids = []

    def run():
        h = FileHistory(tmp_path / "s")  # each its own object, as separate processes would be
        for _ in range(10):
            ids.append(h.begin({"outcome": "in_progress"}))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ids) == 40 and len(set(ids)) == 40


def test_a_torn_last_line_does_not_hide_the_history(tmp_path):
    h = FileHistory(tmp_path / "s")
    h.append({"id": "r0001", "outcome": "succeeded"})
    with open(h.path, "a") as f:
        f.write('{"id": "r0002", "outc')
    assert [r["id"] for r in h.records()] == ["r0001"]


def test_engine_state_lives_with_the_engine_not_in_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("DDSERVE_STATE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    env_file = tmp_path / "etc" / "engine-default.env"
    env_file.parent.mkdir()
    cfg = ServeConfig()
    _, history = make_target("engine", cfg, env_file=str(env_file))
    history.save_deployed({"engine": {"model": "m"}})
    assert Path(history.dir) == tmp_path / "etc" / "engine-default.reconfig"
    assert json.loads((history.dir / "deployed.json").read_text()) == {"engine": {"model": "m"}}
    assert not (tmp_path / "home").exists()
    _, named = make_target("engine", cfg, env_file=str(env_file), state_dir=str(tmp_path / "lib"))
    assert named.dir == tmp_path / "lib"
