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

from ddserve.backends.process import EngineProcess
from ddserve.backends.sglang import sglang_command, sglang_environ
from ddserve.config.deploy import load_config
from ddserve.config.engine import EngineConfig
from ddserve.config.sglang_presets import PRESETS
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


# Flags of presets that SGLang 0.5.23 does not have: their values are checked here, the
# parser cannot check them (test_unverified_flags_really_are_not_upstream keeps this honest).
NOT_IN_0_5_23 = {
    "--speculative-ddtree-budget",  # sglang-pr-29907 and seed-fork
    "--speculative-ddtree-topk",  # seed-fork
    "--speculative-dflash-draft-window-size",  # seed-fork (the pre-rename DFlash name)
}
needs_parser = pytest.mark.skipif(
    not (PARSER_ENV / ".done").exists(), reason="run deploy/install.sh (installs SGLang's parser)"
)


def with_sglang(cfg: EngineConfig, **changes) -> EngineConfig:
    """`cfg` with its sglang section changed, validated as a YAML would be."""
    data = cfg.model_dump()
    data["sglang"] = {
        k: v
        for k, v in {**data["sglang"], **changes}.items()
        if k in cfg.sglang.model_fields_set | set(changes)
    }
    return EngineConfig.model_validate(data)


@needs_parser
@pytest.mark.parametrize("preset", list(PRESETS))
def test_each_preset_parses_with_upstream_sglang(kimi, preset):
    e = with_sglang(kimi.engine, preset=preset)
    m = PRESETS[preset]
    cmd = sglang_command(e, "127.0.0.1", 31000)
    assert cmd[:3] == [e.sglang.python, "-m", "sglang.launch_server"]
    args = cmd[3:]
    for name, flag in m.flags.items():  # every mapped flag carries its parameter's value
        assert args[args.index(flag) + 1] == str(getattr(e.params, name))
    for flag in NOT_IN_0_5_23 & set(args):  # unverifiable here: drop them, parse the rest
        i = args.index(flag)
        del args[i : i + 2]
    parsed = parse_with_sglang(args)
    assert parsed["model_path"] == e.model and parsed["tp_size"] == 8
    assert parsed["speculative_algorithm"] == m.algorithm
    assert parsed["speculative_draft_model_path"] == e.sglang.draft_model_path
    assert parsed["speculative_num_draft_tokens"] == e.sglang.block_size
    upstream_window = m.flags.get("window") == "--speculative-draft-window-size"
    assert parsed["speculative_draft_window_size"] == (2048 if upstream_window else None)
    assert (
        parsed["enable_metrics"] is True
        and parsed["port"] == 31000
        and parsed["host"] == "127.0.0.1"
    )
    assert parsed["served_model_name"] == "kimi-k2" and parsed["mem_fraction_static"] == 0.85
    assert sglang_environ(e) == {var: str(getattr(e.params, n)) for n, var in m.env.items()}


@needs_parser
def test_unverified_flags_really_are_not_upstream():
    """Each flag listed as PR/fork-only is refused by 0.5.23's parser: if a later SGLang
    gains one, this fails and the flag moves to the checked side."""
    script = PARSE.replace(
        "a = p.parse_args(json.loads(sys.argv[1]))\nprint(",
        "bad = []\nfor f in json.loads(sys.argv[1]):\n"
        "    try:\n        p.parse_args(['--model-path', '/m', f, '8'])\n"
        "    except SystemExit:\n        bad.append(f)\nprint(json.dumps(bad))\n#",
    )
    env = {"PYTHONPATH": f"{PARSER_ENV}:{ROOT / 'tests' / 'stubs'}", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [sys.executable, "-c", script, json.dumps(sorted(NOT_IN_0_5_23))],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert set(json.loads(r.stdout.strip().splitlines()[-1])) == NOT_IN_0_5_23


def test_the_pr_preset_passes_topk_as_an_environment_variable(kimi, tmp_path):
    """sglang-pr-29907 takes budget as a flag and topk as SGLANG_DDTREE_MAX_TOPK: the
    launcher starts the SGLang process with it (here a stand-in interpreter records what it
    was started with)."""
    e = with_sglang(kimi.engine, preset="sglang-pr-29907")
    cmd = sglang_command(e, "h", 1)
    assert cmd[cmd.index("--speculative-algorithm") + 1] == "DDTREE"
    assert cmd[cmd.index("--speculative-ddtree-budget") + 1] == "8"
    assert "--speculative-ddtree-topk" not in cmd and "4" not in cmd[cmd.index("--tp-size") + 2 :]
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nenv > {tmp_path / "env"}\necho "$@" > {tmp_path / "argv"}\n')
    fake.chmod(0o755)
    e = with_sglang(e, python=str(fake))
    eng = EngineProcess(e, port=1)
    eng.start()
    eng.proc.wait(10)
    env = dict(
        line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line
    )
    assert env["SGLANG_DDTREE_MAX_TOPK"] == "4"
    assert "--speculative-ddtree-budget 8" in (tmp_path / "argv").read_text()
    ar = e.model_copy(update={"params": e.params.model_copy(update={"budget": 0})})
    assert sglang_environ(ar) == {} and "--speculative-algorithm" not in sglang_command(ar, "h", 1)


def test_the_seed_fork_preset_uses_its_own_window_flag(kimi):
    e = with_sglang(kimi.engine, preset="seed-fork")
    cmd = sglang_command(e, "h", 1)
    assert cmd[cmd.index("--speculative-dflash-draft-window-size") + 1] == "2048"
    assert "--speculative-draft-window-size" not in cmd
    assert cmd[cmd.index("--speculative-ddtree-topk") + 1] == "4"
    assert sglang_environ(e) == {}


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


def test_without_a_preset_the_mapping_is_spelled_out_and_budget_zero_disables_it(kimi):
    e = with_sglang(
        kimi.engine,
        preset=None,
        speculative_algorithm="MYTREE",
        ddtree_flags={"budget": "--ddtree-budget"},
        ddtree_env={"topk": "MY_TOPK"},
    )
    cmd = sglang_command(e, "h", 1)
    assert cmd[cmd.index("--ddtree-budget") + 1] == "8" and "--speculative-ddtree-topk" not in cmd
    assert cmd[cmd.index("--speculative-algorithm") + 1] == "MYTREE"
    assert cmd[cmd.index("--speculative-draft-window-size") + 1] == "2048"  # the default name
    assert sglang_environ(e) == {"MY_TOPK": "4"}
    # the defaults of a section without a preset: as before presets existed
    plain = EngineConfig.model_validate(
        {"kind": "sglang", "sglang": {"draft_model_path": "/d", "ddtree_env": {"topk": "T"}}}
    )
    cmd = sglang_command(plain, "h", 1)
    assert "--speculative-ddtree-budget" in cmd and "--speculative-ddtree-topk" not in cmd
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
    with pytest.raises(ValueError, match="preset='pr-1' is unknown; choose from upstream-0.5.23"):
        EngineConfig.model_validate({"kind": "sglang", "sglang": {"preset": "pr-1"}})
    with pytest.raises(ValueError, match="drop ddtree_flags or drop the preset"):
        EngineConfig.model_validate(
            {"kind": "sglang", "sglang": {"preset": "seed-fork", "ddtree_flags": {}}}
        )
    with pytest.raises(ValueError, match="environment variable names"):
        EngineConfig.model_validate({"kind": "sglang", "sglang": {"ddtree_env": {"topk": "A B"}}})
    with pytest.raises(ValueError, match="in both ddtree_flags and ddtree_env"):
        EngineConfig.model_validate(
            {
                "kind": "sglang",
                "sglang": {"ddtree_flags": {"topk": "--t"}, "ddtree_env": {"topk": "T"}},
            }
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
