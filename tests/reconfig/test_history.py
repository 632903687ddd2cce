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


class GatedTarget:
    """A stand-in target (the controller is under test): its apply waits for `gate`, and the
    config in force is whatever was applied last."""

    name = "gated"

    def __init__(self):
        from ddserve.config.engine import EngineConfig

        self.config = EngineConfig(model="tiny-random")
        self.gate, self.entered = threading.Event(), threading.Event()
        self.applied = []

    def current_config(self):
        return self.config

    def apply(self, desired, plan, attempt, deadline_s, progress):
        self.entered.set()
        self.gate.wait(10)
        self.applied.append((attempt, desired.params.budget))
        self.config = desired
        return []


def test_a_second_reconfiguration_while_one_is_under_way_is_refused(tmp_path):
    """Two operators at once: the second is refused with a line naming the first, touches
    nothing, and the first's change is what serves (before, the later one's rollback undid
    the earlier one's success)."""
    from ddserve.reconfig.controller import Controller

    target, h = GatedTarget(), FileHistory(tmp_path / "s")
    first = {}
    t = threading.Thread(
        target=lambda: first.update(Controller(target, h, progress=lambda _: None).reconfigure(
            {"params.budget": 7}, deadline_s=30
        ))
    )  # fmt: skip
    t.start()
    assert target.entered.wait(10)
    second = Controller(target, h, progress=lambda _: None).reconfigure({"params.budget": 6})
    target.gate.set()
    t.join(10)
    assert second["outcome"] == "refused" and "r0001" in second["error"]
    assert first["outcome"] == "succeeded" and target.applied == [("r0001", 7)]
    assert target.config.params.budget == 7
    assert [r["outcome"] for r in h.records()] == ["succeeded", "refused"]
    # once it has ended, the next one goes ahead
    target.entered.clear()
    assert (
        Controller(target, h, progress=lambda _: None).reconfigure({"params.budget": 5})["outcome"]
        == "succeeded"
    )


def test_an_attempt_whose_controller_died_stops_blocking_after_twice_its_deadline(tmp_path):
    from datetime import UTC, datetime, timedelta

    from ddserve.reconfig.history import STALE_S

    h = FileHistory(tmp_path / "s")
    started = datetime(2026, 12, 7, 1, 0, tzinfo=UTC)
    old = h.begin({"outcome": "in_progress", "started": started.isoformat(), "deadline_s": 30})
    new = h.begin({"outcome": "in_progress", "started": started.isoformat(), "deadline_s": 30})
    assert h.ahead_of(new, started + timedelta(seconds=60 + STALE_S))["id"] == old
    assert h.ahead_of(new, started + timedelta(seconds=61 + STALE_S)) is None
    assert h.ahead_of(old, started) is None  # the older attempt never waits for a newer one


def test_a_deadline_must_be_a_positive_number_of_seconds(tmp_path):
    from ddserve.reconfig.controller import Controller

    target, h = GatedTarget(), FileHistory(tmp_path / "s")
    target.gate.set()
    for bad in (0.0, -5.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="positive number of seconds"):
            Controller(target, h, progress=lambda _: None).reconfigure(
                {"params.budget": 7}, deadline_s=bad
            )
    assert h.records() == [] and target.applied == []


def test_a_reconfiguration_planned_against_a_config_since_replaced_is_refused(tmp_path):
    """B read the config while A was under way, and A has ended since: B's plan would revert
    A's change (both recorded as succeeded), so B is refused and nothing is applied."""
    from ddserve.reconfig.controller import Controller
    from ddserve.reconfig.plan import desired_config

    target, h = GatedTarget(), FileHistory(tmp_path / "s")
    target.gate.set()
    stale = target.current_config()
    quiet = Controller(target, h, progress=lambda _: None)
    assert quiet.reconfigure({"params.budget": 7})["outcome"] == "succeeded"
    late = quiet.apply(stale, desired_config(stale, {"params.topk": 3}))
    assert late["outcome"] == "refused" and "changed" in late["error"]
    assert target.config.params.budget == 7 and target.config.params.topk == 4
    assert len(target.applied) == 1
