"""Stand-in for triton (1 GB GPU compiler): sglang imports it at module load, and its
argument parser never calls it. Decorators pass functions through."""

import sys
import types


def _passthrough(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda fn: fn


jit = autotune = heuristics = _passthrough


class Config:
    def __init__(self, *args, **kwargs):
        pass


def cdiv(a, b):
    return -(-a // b)


def next_power_of_2(n):
    return 1 << (int(n) - 1).bit_length()


__version__ = "0.0.0-stub"


class _Any(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _passthrough


language = _Any("triton.language")
language.constexpr = object
runtime = _Any("triton.runtime")
testing = _Any("triton.testing")
sys.modules.update(
    {"triton.language": language, "triton.runtime": runtime, "triton.testing": testing}
)
