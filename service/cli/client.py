"""The CLI as a client of a server (`chat`, `bench`, `up`, `systemd status`): every answer
that is not a success becomes one ddserve error, hence one line and an exit code
(ddserve.errors.exit_code).

    cannot connect / timed out     EngineUnavailable   "no server answers at URL: connection refused"
    HTTP 4xx/5xx with a body        error_from_body     "URL: <the server's own message>"
    HTTP 200 that is not JSON       EngineError

Requests carry the API key of ddserve.config.api_key (env DDSERVE_API_KEY or its _FILE).
"""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

from ddserve.config import api_key
from ddserve.errors import DDServeError, EngineError, EngineUnavailable, error_from_body


def client_api_key(var: str = api_key.DEFAULT_ENV) -> dict[str, str]:
    """Headers with the key from `$var` / `$var_FILE` (none when unset)."""
    return api_key.bearer(api_key.read_api_key(var))


def origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def unreachable(url: str, exc: httpx.HTTPError) -> EngineUnavailable:
    """A transport failure as one line: what failed, where."""
    if isinstance(exc, httpx.TimeoutException):
        why = "no answer in time"
    elif isinstance(exc, httpx.ConnectError):
        why = str(exc).split("] ", 1)[-1].lower() or "cannot connect"
    else:
        why = f"{type(exc).__name__}: {exc}"
    return EngineUnavailable(f"no server answers at {origin(url)}: {' '.join(why.split())}")


def http_error(url: str, r: httpx.Response, sent_key: bool) -> DDServeError:
    """A non-2xx answer as the error the server's OpenAI body stands for, naming the URL."""
    exc = error_from_body(r.status_code, r.content)
    hint = ""
    if r.status_code == 401 and not sent_key:
        hint = f" (set {api_key.DEFAULT_ENV} or {api_key.DEFAULT_ENV}_FILE to the server's key)"
    said = exc.message.removeprefix(f"engine answered HTTP {r.status_code}: ")
    exc.message = " ".join(f"{url}: HTTP {r.status_code}: {said}{hint}".split())
    exc.args = (exc.message,)
    return exc


def request(
    method: str, url: str, *, headers: dict | None = None, timeout: float = 60.0, **kw
) -> httpx.Response:
    """A successful response, or the ddserve error that says why not (one line)."""
    try:
        r = httpx.request(method, url, headers=headers, timeout=timeout, **kw)
    except httpx.HTTPError as exc:
        raise unreachable(url, exc) from exc
    if not r.is_success:
        raise http_error(url, r, "authorization" in {k.lower() for k in headers or {}})
    return r


def request_json(method: str, url: str, **kw) -> dict:
    r = request(method, url, **kw)
    try:
        return r.json()
    except ValueError as exc:
        raise EngineError(f"{url}: HTTP {r.status_code} but the body is not JSON") from exc


def get_json(url: str, *, headers: dict | None = None, timeout: float = 10.0) -> dict:
    return request_json("GET", url, headers=headers, timeout=timeout)


def post_json(url: str, body: dict, *, headers: dict | None = None, timeout: float = 600.0) -> dict:
    return request_json("POST", url, headers=headers, timeout=timeout, json=body)
