"""Fixtures of the engine's tests."""

import pytest

from ddserve.engine.weights import random_llama, tiny_config


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama (vocabulary 512): the static engine's tests' target."""
    return random_llama(tiny_config(vocab_size=512), seed=3)
