"""The exception tree: every type ddserve raises belongs to it, maps to one HTTP answer and one
exit code, and an error body read back gives the same type."""

from __future__ import annotations

import ast

import pytest

from ddserve import errors
from ddserve.errors import (
    ConfigError,
    Conflict,
    ContextLengthExceeded,
    DDServeError,
    DeadlineExceeded,
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    ModelNotFound,
    OperationFailed,
    Overloaded,
    PayloadTooLarge,
    RolloutFailed,
    SupervisorError,
    Unauthorized,
    error_from_body,
    exit_code,
    openai_error_body,
)
from tests.test_layout import MODULES

# raised inside pydantic validators (pydantic turns them into ValidationError -> ConfigError),
# by abstract methods, and by argparse `type=` functions (argparse prints their one line)
ALLOWED_FOREIGN = {
    "ValueError",
    "NotImplementedError",
    "SystemExit",
    "KeyboardInterrupt",
    "ArgumentTypeError",
}


def test_every_raised_type_is_in_the_tree():
    tree = {
        n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, DDServeError)
    }
    foreign = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                f = node.exc.func
                raised = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                if raised and raised[0].isupper() and raised not in tree | ALLOWED_FOREIGN:
                    foreign.append((name, node.lineno, raised))
    assert foreign == []


@pytest.mark.parametrize(
    "exc, status, code",
    [
        (InvalidRequest("x", param="p"), 400, 2),
        (ContextLengthExceeded("x"), 400, 2),
        (ModelNotFound("x"), 404, 2),
        (Unauthorized("x"), 401, 3),
        (Conflict("x"), 409, 2),
        (ConfigError("x"), 500, 2),
        (PayloadTooLarge("x"), 413, 2),
        (Overloaded("x"), 429, 4),
        (DeadlineExceeded("x"), 504, 4),
        (EngineError("x"), 500, 4),
        (EngineUnavailable("x"), 503, 4),
        (SupervisorError("x"), 500, 5),
        (RolloutFailed("x"), 500, 5),
        (DDServeError("x"), 500, 1),
    ],
)
def test_one_status_and_one_exit_code_per_type(exc, status, code):
    assert openai_error_body(exc)[0] == status
    assert exit_code(exc) == code


@pytest.mark.parametrize(
    "exc",
    [
        InvalidRequest("bad", param="temperature"),
        ModelNotFound("m"),
        Unauthorized("t"),
        Conflict("c"),
        EngineUnavailable("down"),
        EngineError("boom"),
    ],
)
def test_an_error_body_reads_back_as_its_type(exc):
    status, body = openai_error_body(exc)
    back = error_from_body(status, body)
    assert type(back) is type(exc) and exc.message in back.message
    assert back.param == exc.param


def test_error_from_body_survives_non_json_and_odd_shapes():
    assert isinstance(error_from_body(502, b"<html>bad gateway</html>"), EngineError)
    e = error_from_body(422, {"error": "unprocessable"})
    assert isinstance(e, InvalidRequest) and e.status_code == 422 and "unprocessable" in e.message
    assert isinstance(error_from_body(500, [1, 2]), EngineError)


def test_rollout_failed_carries_what_verified():
    assert RolloutFailed("x", replicas=[{"replica": "a"}]).replicas == [{"replica": "a"}]
    assert issubclass(RolloutFailed, OperationFailed)
