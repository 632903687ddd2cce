"""Every EngineConfig field reaches every path: a `ddserve engine` flag, its DDSERVE_* variable,
and a systemd EnvironmentFile written by ddserve and read back. The fields are walked from the
model, so a new field is covered here without touching this file."""

import json
import os

import pytest
from pydantic import BaseModel, Field

from ddserve.cli import build_parser
from ddserve.cli.engine import engine_config_of
from ddserve.config.engine import EngineConfig, validate
from ddserve.config.envfile import (
    CONFIG_VARS,
    env_file_text,
    parse_env_file,
    read_env_file,
    write_env_file,
)
from ddserve.config.flags import (
    BY_PATH,
    ENGINE_FIELDS,
    _check_unique,
    _derive,
    encode_value,
    engine_config_from,
    field_value,
)
from ddserve.errors import ConfigError
from ddserve.reconfig.plan import desired_config, parse_assignments

# a text with everything an EnvironmentFile or a shell could trip over
ODD = "/srv/models/a b'c\"$HOME `x` \\y %i #z;=1"
# configs the samples are tried in: sglang settings and tp_size > 1 need kind=sglang
CONTEXTS = [{}, {"kind": "sglang", "sglang": {}}]


@pytest.fixture(autouse=True)
def _no_config_variables(monkeypatch):
    for name in CONFIG_VARS:
        monkeypatch.delenv(name, raising=False)


def _candidates(spec):
    d = spec.default
    if spec.kind == "bool":
        return [not d]
    if spec.kind == "choice":
        return [c for c in spec.choices if c != d]
    if spec.kind == "int":
        base = d or 0
        return [base + 1, base - 1, 2, 16]
    if spec.kind == "float":
        base = d or 0.0
        return [base + 0.25, base - 0.25, 0.3]
    if spec.kind == "str":
        return [ODD, "v2"]
    if spec.kind == "list":
        return [["budget", "topk"], ["--flag", ODD]]
    return [{}, {"budget": "--b"}, {"k": ODD}]  # object


def _set(data: dict, path: str, value) -> dict:
    *parents, leaf = path.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return data


def sample(spec) -> tuple[dict, EngineConfig]:
    """(the context, a valid config whose `spec` field is not the default)."""
    for ctx in CONTEXTS:
        for value in _candidates(spec):
            try:
                cfg = validate(EngineConfig, _set(json.loads(json.dumps(ctx)), spec.path, value))
            except ConfigError:
                continue
            if field_value(cfg.model_dump(mode="json"), spec.path) != spec.default:
                return ctx, cfg
    raise AssertionError(f"{spec.path}: no sample value is valid; extend _candidates")


def _text(spec, cfg: EngineConfig) -> str:
    return encode_value(spec, field_value(cfg.model_dump(mode="json"), spec.path))


def _flag_args(spec, cfg: EngineConfig) -> list[str]:
    if spec.kind == "bool":
        value = field_value(cfg.model_dump(mode="json"), spec.path)
        return [spec.flag if value else "--no-" + spec.flag[2:]]
    return [spec.flag, _text(spec, cfg)]


PATHS = [s.path for s in ENGINE_FIELDS]


def test_every_model_field_has_a_flag():
    def leaves(model, prefix=""):
        for name, f in model.model_fields.items():
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
                yield from leaves(f.annotation, prefix + name + ".")
            else:
                yield prefix + name

    assert set(leaves(EngineConfig)) == set(BY_PATH)


@pytest.mark.parametrize("path", PATHS)
def test_flag_sets_the_field(path):
    spec = BY_PATH[path]
    ctx, cfg = sample(spec)
    args = ["engine"]
    for p in ctx:
        args += _flag_args(BY_PATH[p], cfg)
    args += _flag_args(spec, cfg)
    assert engine_config_of(build_parser().parse_args(args)) == cfg


@pytest.mark.parametrize("path", PATHS)
def test_variable_sets_the_field(path):
    spec = BY_PATH[path]
    ctx, cfg = sample(spec)
    environ = {BY_PATH[p].env: _text(BY_PATH[p], cfg) for p in [*ctx, path]}
    assert engine_config_from({}, environ=environ) == cfg


@pytest.mark.parametrize("path", PATHS)
def test_env_file_round_trips_the_field(path):
    _, cfg = sample(BY_PATH[path])
    env = parse_env_file(env_file_text(cfg, "test"))
    assert set(env) == CONFIG_VARS  # every field, defaults and unset ones too
    assert engine_config_from({}, environ=env) == cfg


def test_today_flag_and_variable_names_keep_working():
    legacy = "--model --served-name --drafter --dflash-path --draft-model --draft-layers --depth --budget --topk --window --temperature --top-p --top-k --max-context --device --max-batch --dtype --graphs --spec-max-batch --compile"
    flags = {f for s in ENGINE_FIELDS for f in (s.flag, *s.aliases)}
    assert set(legacy.split()) <= flags
    assert BY_PATH["drafter.kind"].env == "DDSERVE_DRAFTER"
    assert BY_PATH["drafter.ngram_max"].flag == "--ngram-max"
    assert BY_PATH["served_name"].flag == "--served-model-name"  # vLLM's and SGLang's name


def test_an_env_file_written_before_a_rename_keeps_working(tmp_path):
    """DDSERVE_SERVED_NAME (the variable of the old flag --served-name) is still read, loses
    to the new DDSERVE_SERVED_MODEL_NAME, and a rewrite moves its value to the new one."""
    assert engine_config_from({}, environ={"DDSERVE_SERVED_NAME": "old"}).served_name == "old"
    both = {"DDSERVE_SERVED_NAME": "old", "DDSERVE_SERVED_MODEL_NAME": "new"}
    assert engine_config_from({}, environ=both).served_name == "new"
    path = tmp_path / "engine.env"
    path.write_text("DDSERVE_SERVED_NAME=old\nDDSERVE_HOST=0.0.0.0\n")
    cfg = engine_config_from({}, environ=read_env_file(path))
    write_env_file(path, cfg)
    env = read_env_file(path)
    assert env["DDSERVE_SERVED_MODEL_NAME"] == "old" and "DDSERVE_SERVED_NAME" not in env
    assert env["DDSERVE_HOST"] == "0.0.0.0"


def test_help_shows_each_field_with_its_description_and_variable():
    engine = build_parser()._subparsers._group_actions[0].choices["engine"]
    text = " ".join(engine.format_help().split())
    for s in ENGINE_FIELDS:
        assert s.flag in text and s.env in text
        assert " ".join(s.help.split())[:40] in text


def test_flag_beats_variable_beats_config_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("engine: {params: {budget: 5, topk: 3}, max_context: 512}")
    env = {"DDSERVE_BUDGET": "6", "DDSERVE_TOPK": "2", "DDSERVE_MAX_CONTEXT": ""}
    cfg = engine_config_from({"--budget": "7"}, config_path=str(f), environ=env)
    assert (cfg.params.budget, cfg.params.topk, cfg.max_context) == (7, 2, 512)


def test_a_json_section_merges_over_the_config_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("engine: {kind: sglang, sglang: {draft_model_path: /m/d, block_size: 16}}")
    cfg = engine_config_from({"--sglang": '{"block_size": 8}'}, config_path=str(f), environ={})
    assert cfg.sglang.draft_model_path == "/m/d" and cfg.sglang.block_size == 8
    lists = engine_config_from({"--restart-fields": "budget, topk"}, environ={})
    assert lists.restart_fields == ["budget", "topk"]


def test_a_bad_value_names_field_and_source():
    with pytest.raises(ConfigError, match=r"params\.budget='x'.*DDSERVE_BUDGET"):
        engine_config_from({}, environ={"DDSERVE_BUDGET": "x"})
    with pytest.raises(ConfigError, match=r"--sglang=.*not valid JSON"):
        engine_config_from({"--sglang": "{x"}, environ={})


def test_a_field_whose_flag_collides_fails_at_definition():
    class Bad(BaseModel):
        port: int = Field(1, description="clashes with `ddserve engine --port`")

    with pytest.raises(ConfigError, match="--port"):
        _check_unique(_derive(Bad))


def test_env_file_rewrite_keeps_other_lines_and_the_file_mode(tmp_path):
    path = tmp_path / "engine.env"
    base = validate(EngineConfig, {"params": {"budget": 6}})
    path.write_text(
        env_file_text(base) + "DDSERVE_HOST=127.0.0.1\n# operator note\nDDSERVE_ADMIN_TOKEN=tok\n"
    )
    os.chmod(path, 0o640)
    write_env_file(path, base.with_params(budget=3), "attempt-1")
    env = read_env_file(path)
    assert env["DDSERVE_BUDGET"] == "3"
    assert env["DDSERVE_HOST"] == "127.0.0.1" and env["DDSERVE_ADMIN_TOKEN"] == "tok"
    text = path.read_text()
    assert "# operator note" in text and text.count("# written by ddserve") == 1
    assert path.stat().st_mode & 0o777 == 0o640
    new = tmp_path / "new.env"
    write_env_file(new, base)
    assert new.stat().st_mode & 0o777 == 0o600  # it may come to hold the admin token


# --- injection: a value must never start a new line in an EnvironmentFile ---

EVIL = "x\nLD_PRELOAD=/tmp/evil.so"


def test_reconfig_refuses_a_newline_in_a_name_or_path():
    current = EngineConfig()
    # `reconfig set drafter.draft_model="x\nLD_PRELOAD=/tmp/evil.so"` (YAML double quotes)
    changes = parse_assignments(['drafter.draft_model="x\\nLD_PRELOAD=/tmp/evil.so"'])
    assert changes["drafter.draft_model"] == EVIL
    with pytest.raises(ConfigError) as e:
        desired_config(current, changes)
    assert "drafter.draft_model=" in e.value.message and "\n" not in e.value.message
    for path, value in [
        ("model", EVIL),
        ("served_name", "a\rb"),
        ("sglang", {"extra_args": ["--x", EVIL]}),
        ("sglang", {"ddtree_flags": {"budget": "--b\x00"}}),
    ]:
        with pytest.raises(ConfigError, match="control characters"):
            validate(EngineConfig, {path: value})


def test_env_file_writer_refuses_control_characters_even_past_validation():
    bad = EngineConfig.model_construct(**{**EngineConfig().__dict__, "served_name": EVIL})
    with pytest.raises(ConfigError) as e:
        env_file_text(bad)
    assert e.value.message.startswith("served_name=") and "\n" not in e.value.message
    # the note (an attempt id) lands in a comment: it stays one line
    text = env_file_text(EngineConfig(), "note\nLD_PRELOAD=/tmp/evil.so")
    assert "LD_PRELOAD" not in parse_env_file(text)
