"""A lean HTTP/1.1 client for one hop: pooled keep-alive connections, answers parsed by
httptools (llhttp, the C parser uvicorn uses), and nothing else.

The router's generation hop only POSTs a body with a few headers, then reads the status and
headers and the body, whole or piece by piece as it arrives. aiohttp's client costs ~0.35-0.4 ms
more a hop than this on a 2-core machine, as much as the router's own work
(`python -m scripts.bench router`: its bare aiohttp forwarder against its socket forwarder). What else
the router sends (health checks, admin calls, files, batches) keeps aiohttp's client.

Contract:
- `UpstreamPool.post()` is an async context manager: it sends the request and yields an
  `UpstreamResponse` once the status line and headers have arrived.
- Leaving the context before the answer ended (an error, a cancel, a timeout, or a caller that
  read no further) closes the connection, so the server sees its caller leave. A connection whose
  answer ended, and that HTTP lets stay open, goes back to the pool for the next request to the
  same address, for at most `idle_timeout` seconds.
- No timeouts of its own beyond connecting: the caller bounds the whole exchange.
- `UpstreamConnectError` when no connection could be made (nothing was sent); `UpstreamError`
  for a connect that timed out, a connection that broke, or an answer that is not HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping

import httptools
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

READ_PAUSE_BYTES = 1 << 20  # body bytes buffered, unread, before the socket stops being read
MAX_IDLE_PER_ADDRESS = 256
_FORBIDDEN_IN_HEADERS = frozenset("\r\n\x00")

PoolKey = tuple[str, str, int]  # scheme, host, port


class UpstreamError(Exception):
    """The exchange failed after a connection was made (or connecting timed out)."""


class UpstreamConnectError(UpstreamError):
    """No connection could be made (or the address is not an http(s) one): nothing was sent."""


class _BadAnswer(Exception):
    """Raised from a parser callback: bytes after the end of the answer, or a switch of
    protocols. The connection cannot be trusted again."""


class UpstreamResponse:
    """One answer: `status`, `headers` and `content_type` once the head arrived; the body with
    `read()` (whole) or `iter_any()` (each piece as it arrives)."""

    __slots__ = ("status", "headers", "_raw_headers", "_head", "_chunks", "_buffered",
                 "_waiter", "_done", "_keep_alive", "_error", "_conn", "_to_eof")

    def __init__(self, conn: _Connection):
        self.status = 0
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self._keep_alive = False
        self._error: UpstreamError | None = None
        self._conn = conn
        self._to_eof = False  # a body that ends when the connection does

    @property
    def content_type(self) -> str:
        raw = self.headers.get("Content-Type")
        if not raw:
            return "application/octet-stream"
        return raw.partition(";")[0].strip().lower()

    @property
    def complete(self) -> bool:
        """The whole answer arrived (read or not)."""
        return self._done

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.iter_any()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def iter_any(self) -> _Pieces:
        """The body's bytes as they arrive: whatever is buffered, joined, per iteration."""
        return _Pieces(self)

    async def _next_piece(self) -> bytes | None:
        while True:
            if self._chunks:
                data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                self._conn.resume()  # if reading paused on a full buffer
                return data
            if self._error is not None:
                raise self._error
            if self._done:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    # fed by the connection ---------------------------------------------------------------------
    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _got_head(self, status: int, to_eof: bool) -> None:
        self.status = status
        self.headers = CIMultiDictProxy(CIMultiDict(
            (k.decode("latin-1"), v.decode("utf-8", "surrogateescape"))
            for k, v in self._raw_headers))
        self._to_eof = to_eof
        if not self._head.done():
            self._head.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered >= READ_PAUSE_BYTES:
            self._conn.pause()
        self._wake()

    def _finish(self, keep_alive: bool) -> None:
        self._done, self._keep_alive = True, keep_alive
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self._done:
            return
        if self._error is None:
            self._error = error
        if not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # retrieved: a caller that left no longer waits on it
        self._wake()


class _Pieces:
    """`async for piece in response.iter_any()`."""

    __slots__ = ("_resp",)

    def __init__(self, resp: UpstreamResponse):
        self._resp = resp

    def __aiter__(self) -> _Pieces:
        return self

    async def __anext__(self) -> bytes:
        data = await self._resp._next_piece()
        if data is None:
            raise StopAsyncIteration
        return data


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one exchange at a time."""

    def __init__(self, pool: UpstreamPool, key: PoolKey):
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.idle_since = 0.0
        self._paused = False
        self._interim = False  # parsing a 1xx answer, which the final one follows

    @property
    def usable(self) -> bool:
        """Open, and not closing: the loop learns of a close one turn after the transport."""
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def begin(self) -> UpstreamResponse:
        self.response = UpstreamResponse(self)
        self._interim = False
        return self.response

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        self.pool._lost(self)

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    # asyncio.Protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        resp = self.response
        if resp is None or resp._done:  # bytes nobody asked for: not a server to trust
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade, _BadAnswer) as exc:
            # An answer that already ended stays whole; bytes after it close the connection.
            inner = exc.__cause__ or exc.__context__  # httptools wraps a callback's error
            why = (str(inner) if isinstance(inner, _BadAnswer) else
                   "the server switched protocols"
                   if isinstance(exc, httptools.HttpParserUpgrade) else str(exc))
            resp._fail(UpstreamError(f"the answer is not valid HTTP: {why}"))
            self.close()

    def eof_received(self) -> bool | None:
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        resp = self.response
        if resp is not None and not resp._done:
            if resp._to_eof and resp._head.done() and exc is None and not self.closed:
                resp._finish(False)  # a body delimited by the connection's end
            else:
                why = f": {exc}" if exc is not None else ""
                resp._fail(UpstreamError(f"the connection closed before the answer ended{why}"))
        self.closed = True
        self.pool._lost(self)

    # httptools callbacks -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        assert self.response is not None
        if self.response._done:
            raise _BadAnswer("bytes after the end of the answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self.response
        assert resp is not None
        status = self.parser.get_status_code()
        if status == 101:
            raise _BadAnswer("the server switched protocols")
        if 100 <= status < 200:  # interim (100 Continue, 103 Early Hints): the final one follows
            self._interim = True
            resp._raw_headers.clear()
            return
        names = {k.lower() for k, _ in resp._raw_headers}
        resp._got_head(status, b"content-length" not in names and b"transfer-encoding" not in names)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._feed(body)

    def on_message_complete(self) -> None:
        assert self.response is not None
        if self._interim:
            self._interim = False  # the final answer follows on the same connection
            return
        self.response._finish(self.parser.should_keep_alive())


class UpstreamPool:
    """Keep-alive connections by address (scheme, host, port), most recently used first."""

    def __init__(self, connect_timeout: float | None = None, idle_timeout: float = 10.0,
                 ssl_context: ssl.SSLContext | None = None):
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self._ssl = ssl_context
        self._idle: dict[PoolKey, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._closed = False

    @property
    def open_connections(self) -> int:
        return len(self._open)

    @contextlib.asynccontextmanager
    async def post(self, url: URL, body: bytes,
                   headers: Mapping[str, str]) -> AsyncIterator[UpstreamResponse]:
        if self._closed:
            raise RuntimeError("the upstream pool is closed")
        data = request_bytes("POST", url, body, headers)
        conn = await self._acquire(url)
        resp = conn.begin()
        reuse = False
        try:
            assert conn.transport is not None
            conn.transport.write(data)
            await resp._head
            yield resp
            reuse = resp._done and resp._keep_alive and resp._error is None
        finally:
            conn.response = None
            if reuse and conn.usable and not self._closed:
                conn.resume()  # a caller that left a big answer unread left reading paused
                self._release(conn)
            else:
                conn.close()

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._open):
            conn.close()  # each leaves the pool (`_lost`) as it closes
        await asyncio.sleep(0)  # let the transports' close callbacks run

    # the pool ----------------------------------------------------------------------------------
    async def _acquire(self, url: URL) -> _Connection:
        scheme, host = url.scheme, url.raw_host
        if scheme not in ("http", "https") or not host or url.port is None:
            raise UpstreamConnectError(f"not an http(s) address: {url}")
        key = (scheme, host, url.port)
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable and now - conn.idle_since < self.idle_timeout:
                return conn
            conn.close()
        return await self._connect(key)

    async def _connect(self, key: PoolKey) -> _Connection:
        scheme, host, port = key
        ctx = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ctx = self._ssl
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: _Connection(self, key), host,
                                                       port, ssl=ctx)
        except TimeoutError:
            raise UpstreamError(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        self._open.add(conn)
        return conn

    def _release(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= MAX_IDLE_PER_ADDRESS:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def _lost(self, conn: _Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle is not None:
            with contextlib.suppress(ValueError):
                idle.remove(conn)
            if not idle:
                del self._idle[conn.key]


def request_bytes(method: str, url: URL, body: bytes, headers: Mapping[str, str]) -> bytes:
    """The request as it goes on the wire: request line, Host, Content-Length, `headers`,
    body. A header with a line break or NUL in it is a ValueError (it would split the request)."""
    lines = [f"{method} {url.raw_path_qs} HTTP/1.1\r\nHost: {url.host_port_subcomponent}\r\n"
             f"Content-Length: {len(body)}\r\n"]
    for name, value in headers.items():
        if not _FORBIDDEN_IN_HEADERS.isdisjoint(name) or not _FORBIDDEN_IN_HEADERS.isdisjoint(
                value):
            raise ValueError(f"header {name!r} holds a line break or NUL")
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("utf-8", "surrogateescape") + body
