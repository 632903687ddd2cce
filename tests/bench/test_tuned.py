"""bench.tuned: a JSON's knobs into the engine's modules, bad ones refused in one line."""

import json

import pytest

from tests.engine.triton_interpreter import interpreted

# under the interpreter's variable, as every test module that imports the kernel modules
# (layer_launch imports triton_hopper's jit functions: made for a GPU here, the kernel
# tests' interpreted kernels could not call them)
with interpreted():
    from ddserve.bench import tuned
    from ddserve.engine import layer_launch, static_models


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.setattr(layer_launch, "SPLIT_K", {})
    monkeypatch.setattr(layer_launch, "TUNE", {})
    monkeypatch.setattr(static_models, "COMPILE_GLUE", static_models.COMPILE_GLUE)


def test_split_k_and_engine_knobs(tmp_path, clean):
    path = tmp_path / "t.json"
    path.write_text(
        json.dumps({"split_k": {"qkv:16": 3, "down:8": 2}, "engine": {"COMPILE_GLUE": False}})
    )
    out = tuned.apply_tune(str(path))
    assert layer_launch.SPLIT_K == {("qkv", 16): 3, ("down", 8): 2}
    assert layer_launch.split_k("qkv", 9) == 3 and layer_launch.split_k("qkv", 17) == 1
    assert static_models.COMPILE_GLUE is False
    assert out["split_k"] == {"qkv:16": 3, "down:8": 2}


@pytest.mark.parametrize("key", ["qkv:12", "attn:16", "qkv", "o:x"])
def test_bad_split_k_key_is_one_line(tmp_path, clean, key):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"split_k": {key: 2}}))
    with pytest.raises(SystemExit, match="split_k key .* is not KERNEL:ROWS"):
        tuned.apply_tune(str(path))
    assert layer_launch.SPLIT_K == {}


def test_layer_kernels_best_sets_and_splits(tmp_path, clean, monkeypatch):
    """A bench.layer_kernels run's JSON: its best sets per row class into TUNE, its best
    splits (a run with --splits) into SPLIT_K, the row limit raised where its fused layer won."""
    monkeypatch.setattr(layer_launch, "FUSED_MAX_ROWS", 16)
    run = {
        "rows": {
            "16": {
                "block_m": 16,
                "best": {"qkv": [0, 256, 8, 1], "attn": [4, 64, 4, 1]},
                "best_split": {"qkv": 3},
                "layer_us": {"fused_best": 30.0, "compile": 35.0},
            },
            "32": {
                "block_m": 32,
                "best": {"down": [16, 256, 4, 3]},
                "layer_us": {"fused_best": 36.0, "compile": 37.0},
            },
        }
    }
    path = tmp_path / "lk.json"
    path.write_text(json.dumps(run))
    tuned.apply_tune(str(path))
    assert layer_launch.TUNE == {("qkv", 16): (0, 256, 8, 1), ("down", 32): (16, 256, 4, 3)}
    assert layer_launch.SPLIT_K == {("qkv", 16): 3}
    assert layer_launch.FUSED_MAX_ROWS == 32
