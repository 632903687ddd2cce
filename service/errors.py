"""The one exception tree of ddserve, and its mapping to HTTP.

    DDServeError                      500 internal_error
    ├── InvalidRequest                400 invalid_request_error (names the bad `param`)
    │   └── ContextLengthExceeded     400 context_length_exceeded
    ├── ModelNotFound                 404 model_not_found
    ├── Unauthorized                  401 invalid_api_key
    ├── Conflict                      409 conflict (the operation belongs elsewhere)
    ├── PayloadTooLarge               413 request_too_large (body over the server's limit)
    ├── Overloaded                    429 server_busy (admission limit; Retry-After says when)
    ├── DeadlineExceeded              504 request_timeout (the server's per-request deadline)
    ├── ConfigError                   bad config file / CLI value (never reaches HTTP)
    └── EngineError                   500 engine_error  (the engine failed while generating)
        └── EngineUnavailable         503 engine_unavailable (not started, dead, shutting down)

Foreign errors (torch, httpx, subprocess) are translated where they cross into ddserve:
``raise EngineError(...) from exc``. `openai_error_body` is the one place that turns an
exception into an OpenAI-style error body.
"""

from __future__ import annotations


class DDServeError(Exception):
    status_code = 500
    error_type = "internal_error"
    code: str | None = None

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


class ConfigError(DDServeError):
    """A config file or CLI value is wrong; the message names the field, value and fix."""

    error_type = "config_error"


class EngineError(DDServeError):
    error_type = "engine_error"


class EngineUnavailable(EngineError):
    status_code = 503
    error_type = "engine_unavailable"


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
