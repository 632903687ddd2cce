"""A bounded schemathesis run over /openapi.json: whatever it sends, never a 5xx."""

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from ddserve.api.app import create_app  # noqa: E402
from ddserve.backends.local import LocalBackend  # noqa: E402
from ddserve.config.engine import EngineConfig  # noqa: E402
from ddserve.engine.runner import EngineRunner  # noqa: E402
from ddserve.engine.weights import load_model  # noqa: E402


@pytest.fixture(scope="module")
def api_schema():
    # its own engine: the fuzzer changes live parameters through /admin/params
    cfg = EngineConfig(model="tiny-random:3", max_context=48)
    runner = EngineRunner(cfg, loaded=load_model(cfg.model))
    runner.start()
    yield schemathesis.openapi.from_asgi("/openapi.json", create_app(LocalBackend(runner)))
    runner.shutdown()


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_gets_a_server_error(case):
    case.call_and_validate(checks=[not_a_server_error])
