import pytest

from ddserve.config.engine import EngineConfig
from ddserve.errors import ConfigError
from ddserve.reconfig.plan import desired_config, parse_assignments, plan


def test_builtin_engine_swaps_all_live_parameters_in_place():
    cur = EngineConfig()
    new = desired_config(
        cur, parse_assignments(["budget=16", "topk=3", "window=512", "temperature=0.7"])
    )
    p = plan(cur, new)
    assert p.strategy == "live" and {c.field for c in p.changes} == {
        "params.budget",
        "params.topk",
        "params.window",
        "params.temperature",
    }


def test_sglang_restarts_for_tree_parameters_but_not_for_sampling_defaults():
    cur = EngineConfig.model_validate(
        {"kind": "sglang", "tp_size": 8, "sglang": {"draft_model_path": "/d"}}
    )
    assert plan(cur, desired_config(cur, {"params.temperature": 0.6})).strategy == "live"
    p = plan(cur, desired_config(cur, {"params.budget": 16, "params.temperature": 0.6}))
    assert p.strategy == "restart"
    assert {c.field: c.strategy for c in p.changes} == {
        "params.budget": "restart",
        "params.temperature": "live",
    }


def test_restart_fields_and_non_parameter_fields_restart():
    cur = EngineConfig(restart_fields=["window"])
    assert plan(cur, desired_config(cur, {"params.window": 64})).strategy == "restart"
    assert plan(cur, desired_config(cur, {"drafter.depth": 4})).strategy == "restart"
    assert plan(cur, cur).strategy == "none"


@pytest.mark.parametrize(
    "items,needle",
    [
        (["budget=-1"], "params.budget=-1"),
        (["topk=0"], "params.topk=0"),
        (["window=0"], "params.window=0"),
        (["temperature=-0.1"], "params.temperature=-0.1"),
        (["temperature=1e-40"], "must be 0 (greedy) or at least 1e-05"),  # cannot generate
        (
            ['drafter.draft_model="x\\nLD_PRELOAD=/tmp/evil.so"'],
            "drafter.draft_model",
        ),  # a YAML "\\n" is a newline
        (["top_p=1.5"], "params.top_p=1.5"),
        (["budget"], "FIELD=VALUE"),
        (["colour=red"], "colour: unknown field"),
        (["drafter.nope=1"], "drafter.nope: unknown field"),
    ],
)
def test_invalid_desired_configs_are_rejected_with_one_line(items, needle):
    with pytest.raises(ConfigError) as e:
        desired_config(EngineConfig(), parse_assignments(items))
    assert needle in e.value.message and "\n" not in e.value.message


def test_sglang_window_below_block_size_is_rejected():
    cur = EngineConfig.model_validate(
        {"kind": "sglang", "sglang": {"draft_model_path": "/d", "block_size": 16}}
    )
    with pytest.raises(ConfigError, match="below the DFlash block size"):
        desired_config(cur, {"params.window": 8})
