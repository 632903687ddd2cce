"""The SGLang launch command, checked against SGLang 0.5.23's own argument parser.

SGLang itself cannot run here (no GPU). deploy/install.sh installs sglang==0.5.23 with
--no-deps into build/sglang-parser plus the modules its parser imports (pybase64, pillow,
msgspec, pyzmq); triton (1 GB, a GPU compiler imported at module load and never called by
the parser) is replaced by the stand-in package tests/stubs/triton.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddserve.backends.sglang import sglang_command
from ddserve.config.deploy import load_config
from ddserve.config.engine import EngineConfig
from ddserve.errors import ConfigError
from ddserve.serve.replica import deployment_options

ROOT = Path(__file__).parents[1]
PARSER_ENV = ROOT / "build" / "sglang-parser"

PARSE = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser(allow_abbrev=False)  # a prefix of a real flag must not pass
ServerArgs.add_cli_args(p)
a = p.parse_args(json.loads(sys.argv[1]))
print(json.dumps({k: v for k, v in vars(a).items() if isinstance(v, (int, float, str, bool, type(None)))}))
"""


def parse_with_sglang(args: list[str]) -> dict:
    env = {"PYTHONPATH": f"{PARSER_ENV}:{ROOT / 'tests' / 'stubs'}", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [sys.executable, "-c", PARSE, json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def kimi():
    return load_config(ROOT / "deploy" / "kimi-tp8.yaml")


@pytest.mark.skipif(
    not (PARSER_ENV / ".done").exists(), reason="run deploy/install.sh (installs SGLang's parser)"
)
def test_command_parses_with_upstream_sglang(kimi):
    e = kimi.engine
    cmd = sglang_command(e, "127.0.0.1", 31000)
    assert cmd[:3] == [e.sglang.python, "-m", "sglang.launch_server"]
    args = cmd[3:]
    # the DDTree flags belong to the user's fork, not upstream: check their values, then drop them
    for name, flag in e.sglang.ddtree_flags.items():
        i = args.index(flag)
        assert args[i + 1] == str(getattr(e.params, name))
        del args[i : i + 2]
    parsed = parse_with_sglang(args)
    assert parsed["model_path"] == e.model and parsed["tp_size"] == 8
    assert parsed["speculative_algorithm"] == "DFLASH"
    assert parsed["speculative_draft_model_path"] == e.sglang.draft_model_path
    assert parsed["speculative_num_draft_tokens"] == e.sglang.block_size
    assert parsed["speculative_draft_window_size"] == e.params.window == 2048
    assert (
        parsed["enable_metrics"] is True
        and parsed["port"] == 31000
        and parsed["host"] == "127.0.0.1"
    )
    assert parsed["served_model_name"] == "kimi-k2" and parsed["mem_fraction_static"] == 0.85


@pytest.mark.skipif(
    not (PARSER_ENV / ".done").exists(), reason="run deploy/install.sh (installs SGLang's parser)"
)
def test_upstream_parser_rejects_a_wrong_flag():
    """The check above can fail: a misspelt flag is refused by SGLang's parser."""
    env = {"PYTHONPATH": f"{PARSER_ENV}:{ROOT / 'tests' / 'stubs'}", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            PARSE,
            json.dumps(
                [
                    "--model-path",
                    "/m",
                    "--speculative-draft-window",
                    "8",
                    "--speculative-ddtree-budget",
                    "8",
                ]
            ),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode != 0 and "unrecognized arguments" in r.stderr


def test_flag_mapping_is_configurable_and_budget_zero_disables_speculation(kimi):
    e = kimi.engine
    custom = e.model_copy(
        update={
            "sglang": e.sglang.model_copy(update={"ddtree_flags": {"budget": "--ddtree-budget"}})
        }
    )
    cmd = sglang_command(custom, "h", 1)
    assert cmd[cmd.index("--ddtree-budget") + 1] == "8" and "--speculative-ddtree-topk" not in cmd
    ar = e.model_copy(update={"params": e.params.model_copy(update={"budget": 0})})
    assert "--speculative-algorithm" not in sglang_command(ar, "h", 1)


def test_sglang_config_rules():
    with pytest.raises(ValueError, match="needs an `sglang:` section"):
        EngineConfig.model_validate({"kind": "sglang"})
    with pytest.raises(ValueError, match="below the DFlash block size"):
        EngineConfig.model_validate(
            {"kind": "sglang", "sglang": {"block_size": 16}, "params": {"window": 8}}
        )
    with pytest.raises(ValueError, match="long flags"):
        EngineConfig.model_validate(
            {"kind": "sglang", "sglang": {"ddtree_flags": {"budget": "ddtree"}}}
        )
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig.model_validate({"tp_size": 2})
    with pytest.raises(ConfigError):
        sglang_command(EngineConfig(), "h", 1)


def test_gpu_replicas_reserve_tp_size_gpus_in_one_bundle(kimi):
    opts = deployment_options(kimi)
    assert opts["ray_actor_options"]["num_gpus"] == 8
    assert (
        opts["placement_group_bundles"] == [{"CPU": 8, "GPU": 8}]
        and opts["placement_group_strategy"] == "STRICT_PACK"
    )
    assert opts["autoscaling_config"]["max_replicas"] == 2
    cpu = deployment_options(load_config(ROOT / "deploy" / "default.yaml"))
    assert (
        cpu["ray_actor_options"]["num_gpus"] == 0
        and "placement_group_bundles" not in cpu
        and cpu["num_replicas"] == 1
    )
