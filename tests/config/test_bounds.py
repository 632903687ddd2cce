"""Values no process down the line can take are refused where they are read, in one line: a
live top_k of 10^20 passed validation and took every replica down at its reconfigure
(msgpack's OverflowError); a config file that is not UTF-8 or nests too deeply was a
traceback; a max_context past the model's own limit was a MemoryError at start."""

import subprocess
import sys

import pytest

from ddserve.config.base import MAX_INT
from ddserve.config.deploy import load_config
from ddserve.config.engine import EngineConfig, LiveParams
from ddserve.engine.build import build_engine
from ddserve.errors import ConfigError
from ddserve.reconfig.plan import desired_config, parse_assignments


@pytest.mark.parametrize(
    "assignment",
    ["top_k=99999999999999999999", "decode_log_interval=1e20", "spec_max_batch=2147483648",
     "chunked_prefill_size=99999999999999999999", "drafter.depth=-99999999999999999999"],
)  # fmt: skip
def test_integers_past_32_bits_are_refused_before_anything_is_touched(assignment):
    with pytest.raises(ConfigError) as err:
        desired_config(EngineConfig(model="m"), parse_assignments([assignment]))
    assert "\n" not in err.value.message and assignment.split("=")[0].split(".")[-1] in str(
        err.value.message
    )


def test_the_largest_32_bit_value_still_goes():
    assert LiveParams(top_k=MAX_INT).top_k == MAX_INT


def test_nan_temperature_is_called_not_finite():
    with pytest.raises(ConfigError, match="finite"):
        desired_config(EngineConfig(model="m"), parse_assignments(["temperature=.nan"]))


def test_config_files_that_are_not_utf8_or_nest_too_deep_are_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad)
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 2000 + "]" * 2000)
    with pytest.raises(ConfigError, match="nests too deeply|not valid YAML"):
        load_config(deep)
    run = subprocess.run(
        [sys.executable, "-m", "ddserve", "status", "--config", str(bad)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_max_context_past_the_models_own_limit_is_refused_at_start():
    with pytest.raises(ConfigError, match="exceeds the model's own limit of 2048"):
        build_engine(EngineConfig(model="tiny-random", device="cpu", max_context=4096))
