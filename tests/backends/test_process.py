"""An engine process started from a config (what a replica does) serves exactly that config:
every field travels in its DDSERVE_* variable, none is inherited from the parent."""

import httpx
import pytest

from ddserve.backends.process import EngineProcess
from ddserve.config.engine import EngineConfig


@pytest.mark.slow
def test_engine_process_serves_exactly_its_config(monkeypatch, tmp_path):
    monkeypatch.setenv("DDSERVE_BUDGET", "5")  # the parent's own variables must not leak in
    monkeypatch.setenv("DDSERVE_MAX_CONTEXT", "128")
    monkeypatch.setenv("DDSERVE_THREADS", "1")
    cfg = EngineConfig.model_validate(
        {
            "model": "tiny-random:7",
            "served_name": "name with 'quotes' and $HOME",
            "drafter": {"ngram_max": 3, "ngram_min": 2},
            "params": {"budget": 6, "topk": 2},
        }
    )
    eng = EngineProcess(cfg, admin_token="tok", log_path=tmp_path / "engine.log")
    eng.start()
    try:
        assert eng.wait_ready(180) == cfg.fingerprint()
        info = httpx.get(eng.url + "/server_info").json()
        assert EngineConfig.model_validate(info["config"]) == cfg
        assert httpx.post(eng.url + "/admin/params", json={"budget": 3}).status_code == 401
    finally:
        eng.stop()
