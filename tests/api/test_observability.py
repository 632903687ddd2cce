"""The engine server's metrics, stats line and access log; its dashboard against a real
Prometheus scraping a real engine server."""

import asyncio
import logging
import shutil

import httpx
import pytest

from ddserve.api.app import create_app
from ddserve.api.generation import Delta
from ddserve.api.observability import MeteredBackend, StatsLog, tree_size
from ddserve.api.prometheus import PrometheusExporter
from ddserve.backends.local import LocalBackend
from ddserve.config.engine import EngineConfig, LiveParams
from ddserve.engine.runner import EngineRunner
from ddserve.engine.sampling import RequestStats, SamplingParams
from ddserve.engine.weights import load_model
from ddserve.errors import InvalidRequest
from tests.api.conftest import running_engine
from tests.serve.prom import dashboard_queries, prometheus, promtool_check_queries, without_data

MODEL = "tiny-random:7"


class Scripted:
    """A backend that streams given deltas (or raises) under live params budget 3, topk 2."""

    kind, model_id, fingerprint = "builtin", "m", "fp_1"
    params = LiveParams(budget=3, topk=2)

    def __init__(self, deltas=(), error=None):
        self.deltas, self.error = deltas, error

    async def stream(self, prompt, sampling):
        for d in self.deltas:
            yield d
        if self.error:
            raise self.error


def _run(backend, prompt=(1, 2, 3, 4)):
    async def go():
        try:
            async for _ in backend.stream(list(prompt), SamplingParams()):
                pass
        except InvalidRequest:
            pass

    asyncio.run(go())


def test_tree_size_is_the_budget_unless_the_depth_cannot_hold_it():
    assert tree_size(budget=3, topk=1, depth=8) == 3
    assert tree_size(budget=16, topk=1, depth=8) == 8  # a chain is at most depth deep
    assert tree_size(budget=16, topk=4, depth=8) == 16
    assert tree_size(budget=10, topk=2, depth=2) == 6  # 2 + 4 nodes in two levels
    assert tree_size(budget=0, topk=4, depth=8) == 0


def test_spec_decode_counters_follow_the_accept_lengths():
    ex = PrometheusExporter("m")
    stats = RequestStats(prompt_tokens=4, completion_tokens=10, verify_rounds=4)
    stats.accept_lengths = [3, 1, 2, 4]  # accepted draft tokens: 2, 0, 1, 3 (+1 bonus each)
    done = Delta("", [7], "fp_1", "length", stats)
    m = MeteredBackend(Scripted([Delta("a", [5], "fp_1"), done]), ex, drafter_depth=8)
    stats_log = StatsLog(m)
    _run(m)
    line = stats_log.line()  # the interval just past, then nothing while idle
    assert (
        "running 0, waiting 0" in line
        and "tau 2.50, acceptance 0.50, requests 1 (0 errors)" in line
    )
    assert stats_log.line() is None
    _run(MeteredBackend(Scripted(error=InvalidRequest("no")), ex, drafter_depth=8))

    def value(name, **labels):
        return ex.registry.get_sample_value(f"ddserve:{name}", {"model_name": "m", **labels})

    assert value("spec_decode_num_drafts_total") == 4
    assert value("spec_decode_num_draft_tokens_total") == 4 * 3  # budget 3 (topk 2, depth 8)
    assert value("spec_decode_num_accepted_tokens_total") == 6
    per_pos = [
        value("spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(4)
    ]
    assert per_pos == [3, 2, 1, None]
    assert value("accept_length_sum") == 10 and value("accept_length_count") == 4
    assert value("generation_tokens_total") == 10 and value("prompt_tokens_total") == 4
    assert value("requests_total", status="ok") == 1
    assert value("requests_total", status="client_error") == 1
    assert value("time_to_first_token_seconds_count") == 1
    assert value("request_queue_time_seconds_count") is None  # phases: only where reported
    assert value("config_info", fingerprint="fp_1", engine="builtin", budget="3", topk="2",
                 window="2048", temperature="0.0", top_p="1.0", top_k="0") == 1  # fmt: skip


@pytest.fixture(scope="module")
def runner():
    cfg = EngineConfig(
        model=MODEL,
        max_context=128,
        graphs="on",  # the static engine (on CPU): a KV pool of max_batch slots
        max_batch=4,
        drafter={"kind": "layer-skip", "layers": 1},
        params={"budget": 4, "topk": 2},
    )
    r = EngineRunner(cfg, loaded=load_model(cfg.model))
    r.start()
    yield r
    r.shutdown()


def test_metrics_stats_line_and_access_log_in_process(runner, caplog):
    app = create_app(LocalBackend(runner), access_log=True, stats_interval_s=0)
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 12, "ignore_eos": True}

    async def go():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as c:
            assert (await c.post("/v1/completions", json=body)).status_code == 200
            assert (await c.post("/v1/completions", json={**body, "top_p": 7})).status_code == 400
            running = f'ddserve:num_requests_running{{model_name="{MODEL}"}} 0.0'
            for _ in range(100):  # the worker retires a finished request at its round's end
                r = await c.get("/metrics")
                if running in r.text:
                    break
                await asyncio.sleep(0.05)
            return r

    with caplog.at_level(logging.INFO):
        r = asyncio.run(go())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert f'ddserve:generation_tokens_total{{model_name="{MODEL}"}} 12.0' in text
    assert f'ddserve:kv_slots_total{{model_name="{MODEL}"}} 4.0' in text
    assert "ddserve:prefill_chunk_tokens{" in text
    assert f'ddserve:num_requests_running{{model_name="{MODEL}"}} 0.0' in text
    assert "ddserve:spec_decode_num_draft_tokens_total" in text

    def total(name):  # the one finished request's value (sum; count 1)
        tag = f'{{model_name="{MODEL}"}}'
        assert f"ddserve:{name}_count{tag} 1.0" in text, name
        return float(text.split(f"ddserve:{name}_sum{tag} ")[1].split()[0])

    # the engine's phases (vLLM's names) within what the server saw: queue + prefill up to
    # the first token, then decode; the server's own TTFT and e2e hold them
    queue, prefill = total("request_queue_time_seconds"), total("request_prefill_time_seconds")
    decode, inference = (
        total("request_decode_time_seconds"),
        total("request_inference_time_seconds"),
    )
    assert queue >= 0 and prefill > 0 and decode > 0
    assert abs(inference - (prefill + decode)) < 1e-6
    assert queue + prefill <= total("time_to_first_token_seconds")
    assert queue + inference <= total("e2e_request_latency_seconds")
    access = [rec.getMessage() for rec in caplog.records if rec.name == "ddserve.access"]
    assert any('"POST /v1/completions HTTP/1.1" 200' in a for a in access), access
    assert any('"POST /v1/completions HTTP/1.1" 400' in a for a in access), access


@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="Debian package prometheus is not installed (deploy/install.sh installs it)",
)
def test_real_prometheus_scrapes_the_engine_and_every_dashboard_query_has_data(tmp_path):
    queries = dashboard_queries(ray=False)
    promtool_check_queries(tmp_path, queries)
    args = ["--model", MODEL, "--max-context", "256", "--graphs", "on", "--max-batch", "4"]
    args += ["--drafter", "layer-skip", "--draft-layers", "1", "--budget", "4", "--topk", "2"]
    with (
        running_engine(*args) as eng,
        prometheus(tmp_path, ray=False, engines=(eng.url[7:],)) as prom,
    ):
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 24, "ignore_eos": True}
        with httpx.Client(base_url=eng.url, timeout=60) as c:
            admin = {"Authorization": "Bearer s3cret"}
            assert c.post("/admin/params", json={"budget": 3}, headers=admin).status_code == 200
            for _ in range(6):  # spread over a few scrapes: rates need two samples
                assert c.post("/v1/completions", json=body).status_code == 200
        # the dashboard reads "none accepted" as 0; here drafts are accepted, per position too
        raw = [
            ("accepted", "ddserve:spec_decode_num_accepted_tokens_total > 0"),
            (
                "position 0",
                'ddserve:spec_decode_num_accepted_tokens_per_pos_total{position="0"} > 0',
            ),
            ("replica label", f'ddserve:requests_total{{replica="{eng.url[7:]}"}}'),
        ]
        empty = without_data(prom, queries + raw, timeout=30)
        assert not empty, f"queries without data from the engine: {empty}"
