"""A minimal HTTP/1.1 client for streaming load: keep-alive connections on asyncio streams.

It sends a POST with a JSON body and yields the response body as it arrives, de-chunked
(`Transfer-Encoding: chunked`), length-delimited or delimited by the server closing; over
http or https. Nothing else: no proxies, redirects, cookies, compression or HTTP/2. It exists
because a load generator must cost little per streamed chunk: on the 2-core machine of
bench/NOTES.md one SSE chunk costs ~100 us of client CPU here and ~350 us through httpx
(httpcore + h11 + anyio), so one client process drives ~3.5x the token rate before its event
loop saturates.

    pool = Pool("http://127.0.0.1:30000", {"authorization": "Bearer ..."})
    async with pool.post("/v1/chat/completions", body) as r:   # r.status, r.headers
        async for piece in r.body():
            ...
    await pool.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from ddserve.errors import EngineError

READ = 1 << 16


class Response:
    def __init__(self, reader: asyncio.StreamReader, status: int, headers: dict[str, str]):
        self.reader, self.status, self.headers = reader, status, headers
        self.complete = False  # the whole body was read: the connection can be reused

    async def body(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (pieces, not lines)."""
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            async for piece in self._chunked():
                yield piece
        elif "content-length" in self.headers:
            left = int(self.headers["content-length"])
            while left > 0:
                piece = await self.reader.read(min(left, READ))
                if not piece:
                    raise EngineError("connection closed inside the body")
                left -= len(piece)
                yield piece
        else:  # delimited by the server closing the connection
            while piece := await self.reader.read(READ):
                yield piece
            return
        self.complete = True

    async def _chunked(self) -> AsyncIterator[bytes]:
        # a parser over a buffer, not readline per chunk: one await per network read
        buf = b""
        while True:
            while b"\r\n" not in buf:
                if not (more := await self.reader.read(READ)):
                    raise EngineError("connection closed inside a chunked body")
                buf += more
            line, buf = buf.split(b"\r\n", 1)
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise EngineError(f"bad chunk size line {line[:40]!r}") from None
            if size == 0:  # the last chunk: optional trailer lines, then an empty line
                while not (buf.startswith(b"\r\n") or b"\r\n\r\n" in buf):
                    if not (more := await self.reader.read(READ)):
                        raise EngineError("connection closed before a chunked body's end")
                    buf += more
                return
            while len(buf) < size + 2:
                if not (more := await self.reader.read(READ)):
                    raise EngineError("connection closed inside a chunk")
                buf += more
            piece, buf = buf[:size], buf[size + 2 :]
            yield piece
            # pieces already in the buffer are yielded without awaiting the network


class Pool:
    """Keep-alive connections to one origin, opened as needed, reused when a response was
    read to its end."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"{base_url!r}: expected http:// or https://")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        self.head = f"host: {parts.netloc}\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in (headers or {}).items()
        )
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _open(self):
        ctx = ssl.create_default_context() if self.tls else None
        return await asyncio.open_connection(self.host, self.port, ssl=ctx, limit=READ)

    async def _send(self, request: bytes):
        """Write the request on a kept-alive connection, or a new one; the status line."""
        while self.idle:
            reader, writer = self.idle.pop()
            try:
                writer.write(request)
                if status_line := await reader.readline():
                    return reader, writer, status_line
            except ConnectionError:
                pass
            writer.close()  # the server closed it while idle: try the next, then a new one
        reader, writer = await self._open()
        writer.write(request)
        return reader, writer, await reader.readline()

    @contextlib.asynccontextmanager
    async def post(self, path: str, body: bytes):
        """POST `body` (JSON) to `path` (under the base URL's path); the open Response."""
        request = (
            f"POST {self.prefix}{path} HTTP/1.1\r\n{self.head}"
            f"content-type: application/json\r\naccept: text/event-stream\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode() + body
        reader, writer, status_line = await self._send(request)
        response = None
        try:
            if not status_line:
                raise EngineError("the server closed the connection without an answer")
            version, _, rest = status_line.decode("latin-1").partition(" ")
            if not version.startswith("HTTP/1."):
                raise EngineError(f"not an HTTP/1.x status line: {status_line[:60]!r}")
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            response = Response(reader, int(rest.split(" ", 1)[0]), headers)
            yield response
        finally:
            keep = (
                response is not None
                and response.complete
                and response.headers.get("connection", "").lower() != "close"
            )
            if keep:
                self.idle.append((reader, writer))
            else:
                writer.close()

    async def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()
