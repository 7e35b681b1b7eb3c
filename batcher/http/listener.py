"""What every listener of replica and router needs around its handlers: `Expect` handling, a
fallback route for unknown paths, reading a body a client may have broken, idle and header
timeouts, and a server log that never quotes what a client sent.

- `expect_continue`: the `expect_handler` of every route.
- `add_fallback_route(app)`: unknown path -> 404, wrong method -> 405 with `Allow`, both through
  the app's middlewares (OpenAI's shape).
- `read_body(request)` / `read_json(request)`: the body, `ApiError` 413 / 400 when it is too large,
  cannot be decoded (bad gzip/deflate, broken chunking), is not JSON or nests too deep.
- `KEEPALIVE_TIMEOUT_S`, `keepalive_timeout()`: the idle and header timeout (env
  `BATCHER_KEEPALIVE_TIMEOUT` overrides it).
- `body_deadline`, `body_timeout(length)`: a body not received whole within
  `BODY_TIMEOUT_S` (env `BATCHER_BODY_TIMEOUT`) plus its length at `MIN_BODY_RATE` is cut off:
  408 and the connection closed. `add_fallback_route` installs it on every listener.
- `QuietServerLog`: aiohttp's server logger minus the raw bytes of requests a client broke.
- `on_stop_signal`: the handler of SIGTERM and SIGINT (Ctrl-C): logs which arrived, then stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

import orjson
from aiohttp import HttpVersion11, web
from aiohttp.http_exceptions import HttpProcessingError

from batcher.http.errors import ApiError, invalid
from batcher.structured.json_limits import MAX_JSON_DEPTH, too_deep

# Connections the kernel queues for a listener before it accepts them: a burst of a thousand
# clients connects at once, and with aiohttp's default (128) the excess SYNs are dropped and
# those clients wait a second to try again.
LISTEN_BACKLOG = 2048

log = logging.getLogger("batcher.http")

# aiohttp closes a connection that has not sent a complete request within `keepalive_timeout`
# of connecting or of its previous response. Partial data does not reset that timer, so it is
# both the idle timeout and the header timeout that cuts off slow-loris clients (headers
# trickled byte by byte); aiohttp's default is an hour. Clients that pool connections should
# drop idle ones sooner than this.
KEEPALIVE_TIMEOUT_S = 20.0


# A body must arrive whole within this many seconds plus its length at MIN_BODY_RATE (64 s
# more for a 16 MiB upload). Without it a client that sends Content-Length: 1000000 and then a
# byte every few seconds holds a connection and a handler forever, before any key is checked
# (a router reads the body before its replica decides on the key).
BODY_TIMEOUT_S = 30.0
MIN_BODY_RATE = 256 * 1024  # bytes a second


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise SystemExit(f"{name} must be seconds > 0, got {raw!r}")
    return value


def keepalive_timeout() -> float:
    """`BATCHER_KEEPALIVE_TIMEOUT` seconds, else `KEEPALIVE_TIMEOUT_S`; SystemExit when bad."""
    return _env_seconds("BATCHER_KEEPALIVE_TIMEOUT", KEEPALIVE_TIMEOUT_S)


def body_timeout(length: int | None) -> float:
    """Seconds a body of `length` bytes (None: chunked, unknown) may take to arrive:
    `BATCHER_BODY_TIMEOUT` (else `BODY_TIMEOUT_S`) plus the length at `MIN_BODY_RATE`."""
    return _env_seconds("BATCHER_BODY_TIMEOUT", BODY_TIMEOUT_S) + (length or 0) / MIN_BODY_RATE


def _body_expired(request: web.Request) -> None:
    content = request.content
    if content.is_eof() or content.exception() is not None:
        return
    # Any read of the body (read_body, multipart, a streamed upload) raises this at once and the
    # middleware answers it; the connection is closed after the answer.
    content.set_exception(BodyTimeout())


class BodyTimeout(ApiError, TimeoutError):
    """408 for a body that did not arrive in time. Also a TimeoutError, which is what aiohttp
    expects when it drains an unread body after the answer (then it closes the connection)."""

    def __init__(self) -> None:
        super().__init__(408, "the request body was not received in time", code="body_timeout",
                         headers={"Connection": "close"})


@web.middleware
async def body_deadline(request: web.Request, handler: Any) -> web.StreamResponse:
    """Cut off a body that has not arrived whole within `body_timeout` of the request's start.
    A handler that answers without reading the body needs nothing: aiohttp closes such a
    connection after a short lingering time."""
    if not request.body_exists:
        return await handler(request)
    timer = asyncio.get_running_loop().call_later(
        body_timeout(request.content_length), _body_expired, request)
    try:
        return await handler(request)
    finally:
        timer.cancel()


async def expect_continue(request: web.Request) -> None:
    """`Expect: 100-continue` is answered as aiohttp does; any other expectation is ignored (RFC
    9110 lets a server do so). aiohttp's own handler would answer it 417 outside the middleware
    (no request ID, not OpenAI's shape), and a 500 when the value is not UTF-8."""
    if (request.version >= HttpVersion11
            and request.headers.get("Expect", "").lower() == "100-continue"):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response proper has not started


# The fallback route's name: what answered no route of the app's own.
NO_ROUTE = "no-route"


def add_fallback_route(app: web.Application) -> None:
    """Route every unknown path or method through the middlewares (404 / 405 with Allow) with
    `expect_continue`, instead of aiohttp's built-in answers, whose `Expect` handling runs before
    any middleware. Every listener calls this, so it also puts `body_deadline` in front of the
    app's middlewares."""
    app.middlewares.insert(0, body_deadline)

    async def no_route(request: web.Request) -> web.StreamResponse:
        allowed: set[str] = set()
        for resource in request.app.router.resources():
            if resource is not fallback:
                allowed |= (await resource.resolve(request))[1]
        if allowed:
            raise web.HTTPMethodNotAllowed(request.method, allowed)
        raise web.HTTPNotFound()

    # [\s\S], not ".": a path may decode to a newline ("/%0A").
    fallback = app.router.add_route("*", r"/{tail:[\s\S]*}", no_route, name=NO_ROUTE,
                                    expect_handler=expect_continue).resource


async def read_body(request: web.Request) -> bytes:
    """The whole body. ApiError 413 over the app's limit, 400 (and the connection closed) when it
    cannot be read as sent."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise ApiError(413, "the request body is too large", code="body_too_large") from exc
    except web.RequestPayloadError as exc:
        why = getattr(exc.__cause__, "message", None) or "bad framing or encoding"
        # Mark the body consumed, or aiohttp re-reads it after the response, logs the error as
        # unhandled and resets the connection, and the client may never see this 400. The
        # connection itself cannot be trusted for another request: close it.
        request.content.feed_eof()
        err = invalid(f"the request body could not be read: {why}", None, "invalid_body")
        err.headers["Connection"] = "close"
        raise err from None
    except ConnectionError:
        # The client closed the connection before its body was whole: one line, not a
        # traceback per cut-off request (any client can repeat it).
        log.info("request to %s: the client closed the connection before its body was whole",
                 request.path)
        raise ApiError(400, "the request body was cut off", code="body_incomplete",
                       headers={"Connection": "close"}) from None


async def read_json(request: web.Request, raw: bytes | None = None) -> Any:
    """The body parsed as JSON (`raw` when already read); ApiError 400 when it is not JSON or
    nests deeper than `MAX_JSON_DEPTH` (code walking it would run out of stack: a 500)."""
    data = await read_body(request) if raw is None else raw
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"the body is not valid JSON: {exc}", None, "invalid_json") from None
    if too_deep(body, MAX_JSON_DEPTH, data):
        raise invalid(f"the body nests lists and objects more than {MAX_JSON_DEPTH} levels deep",
                      None, "json_too_deep")
    return body


class QuietServerLog(logging.LoggerAdapter):
    """aiohttp's server logger, except for what a client broke: a request that is not valid HTTP,
    or a body that cannot be decoded (bad gzip, broken chunking) which aiohttp drains after the
    answer was sent. aiohttp logs each at ERROR with a traceback, the first quoting the raw line
    it could not parse (possibly the client's Authorization header: a key in the log), and any
    client can repeat them to flood the log. Those get one line at DEBUG naming the error class;
    the client still gets its answer (aiohttp's 400 for bad HTTP)."""

    def exception(self, msg: object, *args: object, exc_info: object = True,
                  **kw: object) -> None:
        if isinstance(exc_info, HttpProcessingError | web.RequestPayloadError):
            self.debug("malformed request from a client: %s", type(exc_info).__name__)
            return
        super().exception(msg, *args, exc_info=exc_info, **kw)  # type: ignore[arg-type]


def server_log() -> QuietServerLog:
    return QuietServerLog(logging.getLogger("aiohttp.server"), {})


def on_stop_signal(sig: int, stop: asyncio.Event, logger: logging.Logger, then: str) -> None:
    """A stop signal arrived: say which and what happens next (an operator reads why the
    process ended), once; then set `stop`."""
    if not stop.is_set():
        logger.info("received %s: %s", signal.Signals(sig).name, then)
    stop.set()

def run_event_loop(coro: Any) -> Any:
    """Run a server's main coroutine on uvloop where it is installed, else on asyncio's loop."""
    # NOTE: only uvloop's own import may fall back to asyncio: an ImportError raised inside the
    # server must reach the operator as it is, not as a second run of an awaited coroutine.
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
