import subprocess
import sys
from pathlib import Path

import pytest

from ddserve.config.deploy import load_config
from ddserve.errors import ConfigError

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize(
    "text,needle",
    [
        ("engine: {params: {budget: -3}}", "engine.params.budget=-3"),
        ("replicas: 0", "replicas=0"),
        ("replicas: {min: 3, max: 1}", "min=3 > replicas.max=1"),
        ("engine: {kind: vllm}", "engine.kind='vllm'"),
        ("http: {port: 70000}", "http.port=70000"),
        ("bogus: 1", "bogus: unknown field"),
        ("engine: [1, 2", "not valid YAML"),
        ("- a\n- b", "top level must be a mapping"),
        ("api_server_count: 0", "api_server_count=0"),
        ("api_server_count: 2", "api_server_count=2 needs http.ingress: haproxy"),
        ("replicas: {min: 1, max: 2, upscale_delay_s: -1}", "upscale_delay_s"),
        (
            "api_server_count: 2\nhttp: {ingress: haproxy}\n"
            "engine: {kind: sglang, model: m, sglang: {draft_model_path: d}}",
            "only a builtin engine's replica runs extra API processes",
        ),
    ],
)
def test_bad_configs_name_field_value_and_rule(tmp_path, text, needle):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert needle in e.value.message and "\n" not in e.value.message


def test_shipped_configs_validate():
    assert load_config(ROOT / "deploy" / "default.yaml").engine.kind == "builtin"
    assert load_config(ROOT / "deploy" / "kimi-tp8.yaml").engine.tp_size == 8
    gpu = load_config(ROOT / "deploy" / "smollm2-gpu.yaml")
    assert gpu.engine.device == "cuda" and gpu.engine.num_scheduler_steps == 4
    assert gpu.engine.speculative_adaptive and gpu.engine.params.budget == 15
    assert gpu.engine.first_token_share == 0.5
    assert gpu.max_ongoing_requests >= gpu.engine.max_batch  # Serve lets every slot fill


def test_cli_up_with_a_bad_config_exits_2_with_one_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("engine: {params: {topk: 0}}")
    r = subprocess.run(
        [sys.executable, "-m", "ddserve", "up", "--config", str(p)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        r.returncode == 2
        and r.stderr.strip().count("\n") == 0
        and "engine.params.topk=0" in r.stderr
    )
