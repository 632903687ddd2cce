"""Every error as an HTTP answer with an OpenAI body: ddserve's own (via
`ddserve.errors.openai_error_body`, the one mapping), request validation, and Starlette's
(unknown route, wrong method, unreadable or too deeply nested body); plus the error
responses the OpenAPI schema declares."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from ddserve.errors import InvalidRequest, Overloaded, openai_error_body


class ErrorBody(BaseModel):
    error: dict = Field(description="{message, type, param, code}, as OpenAI's API")


ERRORS: dict = {
    status: {"model": ErrorBody, "description": what}
    for status, what in {
        400: "invalid request (names the bad param)",
        401: "admin token missing or wrong",
        404: "unknown model or endpoint",
        409: "the operation belongs elsewhere",
        413: "request body over --max-body-bytes",
        429: "over --max-requests in flight; see Retry-After",
        500: "the engine failed",
        503: "the engine is not available",
        504: "past --request-timeout",
    }.items()
}


def error_response(exc: BaseException, headers: dict | None = None) -> JSONResponse:
    status, body = openai_error_body(exc)
    if isinstance(exc, Overloaded):
        headers = {**(headers or {}), "Retry-After": str(exc.retry_after)}
    return JSONResponse(body, status_code=status, headers=headers)


def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (unknown route, wrong method, unreadable body) as OpenAI bodies."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        err = InvalidRequest(f"there is no endpoint {where}", code="not_found")
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        err = InvalidRequest(
            f"{where}: method not allowed; use {allowed}", code="method_not_allowed"
        )
    elif isinstance(exc.__cause__, RecursionError):
        err = InvalidRequest("the request body's JSON is nested too deeply", code="json_too_deep")
    else:
        err = InvalidRequest(f"{where}: {exc.detail}")
    err.status_code = exc.status_code
    return error_response(err, headers=exc.headers)


SHOWN_CHARS = 80  # of a refused value, in its error message


# how pydantic names the member of a union (`str | list[str]`) in an error's location
UNION_MEMBERS = {"str", "int", "float", "bool", "dict", "list", "none", "bytes"}


def _field_path(loc) -> list[str]:
    """An error's location as the request's field path: without "body" and without the
    union members pydantic inserts (`stop.list[str].0` -> `stop.0`, `content.str` ->
    `content`; a validator's member, `function-after[...]`, has brackets too)."""
    return [
        str(p)
        for p in loc
        if p != "body" and not (isinstance(p, str) and (p in UNION_MEMBERS or "[" in p))
    ]


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    # of a value that fits no member of a union, pydantic reports each member's error: the
    # deepest one is the member the value was meant for (a list of one bad string: that
    # string's error, not "should be a valid string" of the whole list)
    errors = exc.errors()
    err = max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {}
    loc = _field_path(err.get("loc", ()))
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if not param and err.get("type") in ("model_attributes_type", "dict_type", "missing"):
        return "the request body must be a JSON object (Content-Type: application/json)", None
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if param and "input" in err and not isinstance(err["input"], dict | list):
        shown = repr(err["input"])  # a long text is shown by its start
        if len(shown) > SHOWN_CHARS:
            shown = shown[: SHOWN_CHARS - 3] + "..."
        return f"{param}={shown}: {msg}", param
    return (f"{param}: {msg}" if param else msg), param
