"""The limits a production server keeps, so one request can never stall or starve the rest.

ServerLimits      the numbers (`ddserve engine` flags; `create_app(limits=...)`)
BodySizeLimit     pure ASGI middleware: bodies over `max_body_bytes` answered 413, never
                  buffered (Content-Length checked first; chunked bodies counted as they
                  arrive), so it protects every app built by `create_app`, Ray replicas too
Admission         at most `max_requests` generations in flight; more answered 429 at once
guarded()         a non-streaming generation under the deadline, cancelled as soon as its
                  client disconnects (the engine frees the request's slot)
deadline_stream() a stream under the deadline
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from ddserve.errors import (
    ClientDisconnected,
    DeadlineExceeded,
    Overloaded,
    PayloadTooLarge,
    openai_error_body,
)

T = TypeVar("T")

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is there
DRAIN_S = 2.0  # at most this long spent discarding an oversized body so the client reads 413


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 8 << 20
    """Largest request body; larger ones are answered 413 before they are read."""
    request_timeout_s: float | None = 600.0
    """Deadline of one request (queueing + generation); past it 504. None: no deadline."""
    max_requests: int | None = 256
    """Generation requests in flight (running + waiting) at most; more are answered 429."""
    retry_after_s: int = 1
    """Retry-After of a 429."""


def _error_message(exc: Exception, extra_headers: list | None = None) -> tuple[dict, dict]:
    status, body = openai_error_body(exc)
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"connection", b"close"),
        *(extra_headers or []),
    ]
    return (
        {"type": "http.response.start", "status": status, "headers": headers},
        {"type": "http.response.body", "body": payload},
    )


class BodySizeLimit:
    """Pure ASGI middleware: a request body over `max_bytes` gets 413 and is never kept.

    A Content-Length over the limit is refused before the app runs; a chunked body is
    counted as it arrives and refused the moment it passes the limit (whatever the app
    answered to its truncated body is replaced). The rest of the body is read and dropped
    for at most DRAIN_S so that an HTTP/1.1 client still reads the 413 (closing on unread
    data resets the connection), then the connection is closed. A client that sent
    `Expect: 100-continue` has sent no body yet and is answered at once."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: int | None) -> PayloadTooLarge:
        said = f"is {size} bytes" if size is not None else "is larger than that"
        return PayloadTooLarge(
            f"this server takes request bodies of at most {self.max_bytes} bytes "
            f"(`ddserve engine --max-body-bytes`); this one {said}"
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        declared = int(declared) if declared and declared.isdigit() else None
        if declared is not None and declared > self.max_bytes:
            # a client that waits for "100 Continue" has sent nothing yet: answer at once
            if _header(scope, b"expect") != b"100-continue":
                await _drain(receive, more=True)
            for message in _error_message(self._too_large(declared)):
                await send(message)
            return
        state = {"received": 0, "over": False, "more": True, "started": False}

        async def counted_receive():
            message = await receive()
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                state["more"] = message.get("more_body", False)
                if state["received"] > self.max_bytes:
                    state["over"] = True
                    raise self._too_large(None)
            return message

        async def guarded_send(message):
            if state["over"]:
                return  # the app's answer to a truncated body never goes out
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except PayloadTooLarge:
            if not state["over"]:
                raise
        if state["over"] and not state["started"]:
            await _drain(receive, more=state["more"])
            for message in _error_message(self._too_large(None)):
                await send(message)


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.lower()
    return None


async def _drain(receive, *, more: bool) -> None:
    """Read and drop what is left of a body, for at most DRAIN_S."""
    try:
        async with asyncio.timeout(DRAIN_S):
            while more:
                message = await receive()
                more = message["type"] == "http.request" and message.get("more_body", False)
    except TimeoutError:
        pass


class Admission:
    """Counts generation requests in flight; `enter` refuses any over the limit (429). A
    completions request with n prompts is n generations."""

    def __init__(self, limit: int | None, retry_after_s: int):
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.active = 0

    def enter(self, n: int = 1) -> None:
        if self.limit is not None and self.active + n > self.limit:
            more = f" and this request needs {n} more" if n > 1 else ""
            exc = Overloaded(
                f"the server has {self.active} requests in flight{more}, its limit is "
                f"{self.limit} (`ddserve engine --max-requests`); retry after {self.retry_after_s}s"
            )
            exc.retry_after = self.retry_after_s
            raise exc
        self.active += n

    def leave(self, n: int = 1) -> None:
        self.active -= n


def deadline_of(limits: ServerLimits) -> float | None:
    """The loop-clock time a request that starts now must end by."""
    if limits.request_timeout_s is None:
        return None
    return asyncio.get_running_loop().time() + limits.request_timeout_s


def _timeout_error(started: float) -> DeadlineExceeded:
    return DeadlineExceeded(
        f"the request did not finish within the server's deadline "
        f"({time.monotonic() - started:.0f}s; `ddserve engine --request-timeout`)"
    )


async def guarded(request, work: Awaitable[T], deadline: float | None) -> T:
    """Await `work` until the deadline (504) or until the client disconnects (then the work
    is cancelled, which cancels its engine request, and ClientDisconnected is raised)."""
    started = time.monotonic()
    task = asyncio.ensure_future(work)
    try:
        async with asyncio.timeout_at(deadline):
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    raise ClientDisconnected("the client left before the answer")
    except TimeoutError as exc:
        raise _timeout_error(started) from exc
    finally:
        if not task.done():
            task.cancel()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task.result()


async def deadline_stream(stream: AsyncIterator[T], deadline: float | None) -> AsyncIterator[T]:
    """`stream` until the deadline; past it the stream is cancelled and DeadlineExceeded
    raised (before the first chunk a 504, after it an error event)."""
    started = time.monotonic()
    it = aiter(stream)
    try:
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    item = await anext(it)
            except StopAsyncIteration:
                return
            except TimeoutError as exc:
                raise _timeout_error(started) from exc
            yield item
    finally:
        await it.aclose()  # a consumer that stops early cancels the generation now
