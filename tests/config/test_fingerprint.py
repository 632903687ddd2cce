"""The engine's fingerprint (`system_fingerprint`, and what the reconfig controller verifies a
restart by): a field that needs a new engine process moves it when set, so the new process is
told apart from the old one that still answers; at its default it leaves the fingerprints of
configs without it where they were."""

import pytest

from ddserve.config.engine import EngineConfig

BASE = {"model": "tiny-random", "device": "cpu", "drafter": {"kind": "none"}}


@pytest.mark.parametrize(
    "field,default,value",
    [
        ("speculative_adaptive", False, True),
        ("spec_max_batch", None, 8),
        ("stream_interval", 1, 4),
        ("num_scheduler_steps", 1, 4),
        ("first_token_share", 0.0, 0.5),
    ],
)
def test_a_restart_field_moves_the_fingerprint_only_off_its_default(field, default, value):
    plain = EngineConfig(**BASE).fingerprint()
    assert EngineConfig(**BASE, **{field: default}).fingerprint() == plain
    assert EngineConfig(**BASE, **{field: value}).fingerprint() != plain


def test_live_parameters_move_it_too():
    plain = EngineConfig(**BASE)
    assert plain.with_params(budget=4).fingerprint() != plain.fingerprint()
