"""The one exception tree of ddserve, and its mapping to HTTP.

    DDServeError                      500 internal_error                       CLI exit 1
    ├── InvalidRequest                400 invalid_request_error (names `param`)    exit 2
    │   └── ContextLengthExceeded     400 context_length_exceeded
    ├── ModelNotFound                 404 model_not_found                          exit 2
    ├── Unauthorized                  401 invalid_api_key                          exit 3
    ├── Conflict                      409 conflict (the operation belongs elsewhere) exit 2
    ├── PayloadTooLarge               413 request_too_large (body over the server's limit) exit 2
    ├── Overloaded                    429 server_busy (admission limit; Retry-After says when) exit 4
    ├── DeadlineExceeded              504 request_timeout (the server's per-request deadline) exit 4
    ├── ClientDisconnected            499 (logged only: the client left; its generation is cancelled)
    ├── ConfigError                   a config file, CLI value or model spec is wrong (never
    │                                 reaches HTTP: a server refuses to start)     exit 2
    ├── EngineError                   500 engine_error (the engine failed while generating) exit 4
    │   └── EngineUnavailable         503 engine_unavailable (not started, dead, unreachable)
    └── OperationFailed               an operation on a deployment failed           exit 5
        ├── SupervisorError           systemctl / the process supervisor refused or failed
        └── RolloutFailed             a reconfiguration did not verify (it was rolled back)

Foreign errors (torch, httpx, subprocess) are translated where they cross into ddserve:
``raise EngineError(...) from exc``. `openai_error_body` is the one place that turns an
exception into an OpenAI-style error body; `exit_code` the one place that turns it into the
CLI's exit status.
"""

from __future__ import annotations

import json


class DDServeError(Exception):
    status_code = 500
    error_type = "internal_error"
    code: str | None = None
    # counted in ddserve:requests_total where it was raised (a request's engine stream): the
    # HTTP handler does not count it again (ddserve.api.observability.MeteredBackend.refused)
    counted = False

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(DDServeError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class ModelNotFound(DDServeError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class Unauthorized(DDServeError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class Conflict(DDServeError):
    status_code = 409
    error_type = "invalid_request_error"
    code = "conflict"


class PayloadTooLarge(DDServeError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class Overloaded(DDServeError):
    """Too many requests in flight; `retry_after` (seconds) goes out as Retry-After."""

    status_code = 429
    error_type = "rate_limit_error"
    code = "server_busy"
    retry_after = 1


class DeadlineExceeded(DDServeError):
    status_code = 504
    error_type = "timeout_error"
    code = "request_timeout"


class ClientDisconnected(DDServeError):
    """The client of a non-streaming request went away; its generation was cancelled (nobody
    reads the answer; 499 as nginx logs it)."""

    status_code = 499
    error_type = "client_closed_request"


class ConfigError(DDServeError):
    """A config file or CLI value is wrong; the message names the field, value and fix."""

    error_type = "config_error"


class EngineError(DDServeError):
    error_type = "engine_error"


class EngineUnavailable(EngineError):
    status_code = 503
    error_type = "engine_unavailable"


class OperationFailed(DDServeError):
    """An operation on a deployment (install, restart, roll out) failed; the message says which
    step and what the system said."""

    error_type = "operation_failed"


class SupervisorError(OperationFailed):
    """systemctl, or the supervisor standing in for it, refused or failed."""


class RolloutFailed(OperationFailed):
    """A target could not apply or verify a config; `replicas` holds what did verify."""

    def __init__(self, message: str, replicas: list[dict] | None = None):
        super().__init__(message)
        self.replicas = replicas or []


EXIT_CODES: tuple[tuple[type[DDServeError], int], ...] = (
    (Unauthorized, 3),
    (InvalidRequest, 2),
    (ModelNotFound, 2),
    (Conflict, 2),
    (PayloadTooLarge, 2),
    (ConfigError, 2),
    (Overloaded, 4),
    (DeadlineExceeded, 4),
    (EngineError, 4),
    (OperationFailed, 5),
)


def exit_code(exc: DDServeError) -> int:
    """The CLI's exit status for an error: the first class in EXIT_CODES it is an instance of."""
    return next((code for cls, code in EXIT_CODES if isinstance(exc, cls)), 1)


def error_from_body(status: int, body: bytes | dict) -> DDServeError:
    """The inverse of `openai_error_body`: the exception an OpenAI error answer stands for
    (a client of an engine or of the API re-raises what the server said)."""
    if isinstance(body, bytes | bytearray):
        try:
            body = json.loads(body)
        except ValueError:
            body = {"error": {"message": body.decode(errors="replace")[:300]}}
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        err = {"message": str(err if err is not None else body)[:300]}
    msg = err.get("message") or f"HTTP {status}"
    param, code = err.get("param"), err.get("code")
    if status == 401:
        return Unauthorized(msg)
    if status == 404:
        return ModelNotFound(msg, param=param)
    if status == 409:
        return Conflict(msg, param=param)
    if status == 413:
        return PayloadTooLarge(msg)
    if status == 429:
        return Overloaded(msg)
    if status == 504:
        return DeadlineExceeded(msg)
    if 400 <= status < 500:
        exc = InvalidRequest(msg, param=param, code=code)
        exc.status_code = status  # other 4xx pass through as the server said
        return exc
    if status == 503:
        return EngineUnavailable(f"engine answered HTTP {status}: {msg}")
    return EngineError(f"engine answered HTTP {status}: {msg}")


def openai_error_body(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, ``{"error": {message, type, param, code}}``) for any exception."""
    if isinstance(exc, DDServeError):
        status, etype, msg = exc.status_code, exc.error_type, exc.message
        param, code = exc.param, exc.code
    else:
        status, etype, msg, param, code = (
            500,
            "internal_error",
            f"internal error: {exc}",
            None,
            None,
        )
    return status, {"error": {"message": msg, "type": etype, "param": param, "code": code}}
