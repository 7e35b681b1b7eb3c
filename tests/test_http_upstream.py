"""The lean upstream client (`batcher.http.upstream`) against a real aiohttp server on
127.0.0.1: keep-alive reuse, chunked streams, a caller that leaves closes its connection, and
every way an exchange can fail."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web
from yarl import URL

import batcher.http.upstream as upstream_module
from batcher.http.upstream import (
    READ_PAUSE_BYTES,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    request_bytes,
)


@pytest.fixture
async def upstream(aiohttp_server):
    seen: dict[str, object] = {"peers": [], "left": asyncio.Event(), "headers": None}

    async def echo(request: web.Request) -> web.Response:
        seen["peers"].append(request.transport.get_extra_info("peername"))
        seen["headers"] = request.headers.copy()
        return web.json_response({"got": (await request.read()).decode()},
                                 headers={"X-Replica-State": '{"a":1}'})

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = int(request.query.get("n", "3"))
        try:
            for i in range(n):
                await resp.write(b"data: %d\n\n" % i)
                await asyncio.sleep(0.01)
            if request.query.get("hold"):
                await asyncio.sleep(30)
        except (asyncio.CancelledError, ConnectionResetError):
            seen["left"].set()
            raise
        await resp.write_eof()
        return resp

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * (3 * READ_PAUSE_BYTES + 7))

    async def status(request: web.Request) -> web.Response:
        return web.json_response({"error": "busy"}, status=503, headers={"Retry-After": "2"})

    app = web.Application(handler_args={"keepalive_timeout": 20})
    app.router.add_post("/echo", echo)
    app.router.add_post("/stream", stream)
    app.router.add_post("/big", big)
    app.router.add_post("/status", status)
    server = await aiohttp_server(app)
    return URL(f"http://127.0.0.1:{server.port}"), seen


async def test_whole_answers_reuse_one_connection(upstream) -> None:
    base, seen = upstream
    pool = UpstreamPool(connect_timeout=5)
    for i in range(3):
        async with pool.post(base / "echo", b"hello %d" % i,
                             {"Content-Type": "application/json", "X-Request-Id": "r1"}) as up:
            assert up.status == 200 and up.content_type == "application/json"
            assert up.headers.get("x-replica-state") == '{"a":1}'  # any case
            assert await up.read() == b'{"got": "hello %d"}' % i
    assert len(set(seen["peers"])) == 1 and pool.open_connections == 1
    assert seen["headers"]["X-Request-Id"] == "r1"
    assert seen["headers"]["Host"] == f"127.0.0.1:{base.port}"
    await pool.close()


async def test_streams_arrive_piece_by_piece_decoded_from_chunks(upstream) -> None:
    base, _ = upstream
    pool = UpstreamPool()
    async with pool.post(base / "stream", b"", {}) as up:
        assert up.content_type == "text/event-stream"
        pieces = [p async for p in up.iter_any()]
    assert b"".join(pieces) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert len(pieces) >= 2  # relayed as they came, not collected
    assert pool.open_connections == 1  # the ended stream left its connection for the next
    async with pool.post(base / "echo", b"again", {}) as up:
        assert up.status == 200 and b"again" in await up.read()
    assert pool.open_connections == 1
    await pool.close()


async def test_a_caller_that_leaves_mid_stream_closes_the_connection(upstream) -> None:
    base, seen = upstream
    pool = UpstreamPool()
    async with pool.post(URL(str(base / "stream") + "?n=2&hold=1"), b"", {}) as up:
        async for piece in up.iter_any():
            assert piece.startswith(b"data: 0")
            break
    await asyncio.wait_for(seen["left"].wait(), 5)  # the server saw its caller go
    assert pool.open_connections == 0
    await pool.close()


async def test_a_cancelled_exchange_closes_the_connection(upstream) -> None:
    base, seen = upstream
    pool = UpstreamPool()

    async def read_all() -> None:
        async with pool.post(URL(str(base / "stream") + "?n=1&hold=1"), b"", {}) as up:
            await up.read()

    task = asyncio.create_task(read_all())
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(seen["left"].wait(), 5)
    assert pool.open_connections == 0
    await pool.close()


async def test_error_answers_are_answers_and_big_bodies_pause_reading(upstream) -> None:
    base, _ = upstream
    pool = UpstreamPool()
    async with pool.post(base / "status", b"{}", {}) as up:
        assert up.status == 503 and up.headers["Retry-After"] == "2"
        assert b"busy" in await up.read()
    async with pool.post(base / "big", b"", {}) as up:
        await asyncio.sleep(0.2)  # the server writes it all; the client buffers only so much
        assert up._buffered <= READ_PAUSE_BYTES + (1 << 17)
        assert len(await up.read()) == 3 * READ_PAUSE_BYTES + 7
    assert pool.open_connections == 1  # both kept alive
    await pool.close()


async def test_nothing_listening_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        pool = UpstreamPool(connect_timeout=2)
        with pytest.raises(UpstreamConnectError):
            async with pool.post(URL(f"http://127.0.0.1:{port}/x"), b"", {}):
                pass
    await pool.close()


async def _raw_server(reply: bytes) -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("reply", [
    b"NOT HTTP AT ALL\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
    b"",
])
async def test_broken_answers_are_upstream_errors(reply: bytes) -> None:
    server, port = await _raw_server(reply)
    pool = UpstreamPool()
    with pytest.raises(UpstreamError) as info:
        async with pool.post(URL(f"http://127.0.0.1:{port}/x"), b"{}", {}) as up:
            await up.read()
    assert not isinstance(info.value, UpstreamConnectError)  # it connected
    assert pool.open_connections == 0
    server.close()
    await server.wait_closed()
    await pool.close()


async def test_a_body_that_ends_with_the_connection_is_whole() -> None:
    server, port = await _raw_server(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it")
    pool = UpstreamPool()
    async with pool.post(URL(f"http://127.0.0.1:{port}/x"), b"", {}) as up:
        assert await up.read() == b"all of it"
    assert pool.open_connections == 0
    server.close()
    await server.wait_closed()
    await pool.close()


async def test_a_connect_that_hangs_times_out_as_an_upstream_error(monkeypatch) -> None:
    async def never(*args, **kwargs):
        await asyncio.sleep(60)

    pool = UpstreamPool(connect_timeout=0.05)
    monkeypatch.setattr(asyncio.get_running_loop(), "create_connection", never)
    with pytest.raises(UpstreamError, match="timed out"):
        async with pool.post(URL("http://127.0.0.1:9/x"), b"", {}):
            pass
    await pool.close()


def test_headers_cannot_split_the_request() -> None:
    url = URL("http://[::1]:8000/v1/completions?x=1")
    head = request_bytes("POST", url, b"{}", {"X-Request-Id": "abc"})
    assert head == (b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: [::1]:8000\r\n"
                    b"Content-Length: 2\r\nX-Request-Id: abc\r\n\r\n{}")
    for bad in ({"X-A": "v\r\nX-Injected: 1"}, {"X-A\n": "v"}, {"X-A": "v\x00"}):
        with pytest.raises(ValueError):
            request_bytes("POST", url, b"", bad)
    with pytest.raises(UpstreamConnectError, match="not an http"):
        asyncio.run(_post_to(URL("ftp://127.0.0.1:1/x")))


async def _post_to(url: URL) -> None:
    pool = UpstreamPool()
    async with pool.post(url, b"", {}):
        pass


async def _scripted(replies: list[bytes]) -> tuple[asyncio.Server, URL, dict[str, int]]:
    """A server that answers the n-th request on a connection with `replies[n]`."""
    seen = {"connections": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen["connections"] += 1
        try:
            for reply in replies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(reply)
                await writer.drain()
            await reader.read()  # until the client closes
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, URL(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/x"), seen


async def _exchange(pool: UpstreamPool, url: URL, read: bool = True) -> tuple[int, bytes]:
    async with asyncio.timeout(5), pool.post(url, b"{}", {}) as up:
        return up.status, (await up.read() if read else b"")


async def test_interim_answers_are_skipped_and_a_protocol_switch_is_refused() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    server, url, _ = await _scripted([
        b"HTTP/1.1 100 Continue\r\n\r\n" + ok,
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + ok,
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n"])
    pool = UpstreamPool()
    assert await _exchange(pool, url) == (200, b"ok")
    async with pool.post(url, b"{}", {}) as up:
        assert up.status == 200 and "Link" not in up.headers  # not the hint's headers
        assert await up.read() == b"ok"
    with pytest.raises(UpstreamError, match="switched protocols"):
        await _exchange(pool, url)
    assert pool.open_connections == 0
    server.close()
    await pool.close()


async def test_bytes_after_an_answer_keep_it_whole_and_close_the_connection() -> None:
    server, url, seen = await _scripted([
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
        b"HTTP/1.1 200 OK\r\nX-Evil: 1\r\nContent-Length: 5\r\n\r\nEVIL!"])
    pool = UpstreamPool()
    async with pool.post(url, b"{}", {}) as up:
        assert await up.read() == b"hello" and "X-Evil" not in up.headers
    assert pool.open_connections == 0  # not reused
    assert await _exchange(pool, url) == (200, b"hello")
    assert seen["connections"] == 2
    server.close()
    await pool.close()


async def test_a_big_answer_left_unread_does_not_stall_the_next_exchange(monkeypatch) -> None:
    monkeypatch.setattr(upstream_module, "READ_PAUSE_BYTES", 8)  # "big": over 8 unread bytes
    server, url, seen = await _scripted([
        b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n" + b"x" * 20,
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nsmall"])
    pool = UpstreamPool()
    async with asyncio.timeout(5), pool.post(url, b"{}", {}) as up:
        while not up.complete:  # all of it arrives; the caller reads none of it
            await asyncio.sleep(0.01)
        assert up._conn._paused  # and reading stopped there
    assert await _exchange(pool, url) == (200, b"small")
    assert seen["connections"] == 1  # the same connection, reading again
    server.close()
    await pool.close()


async def test_a_connection_closing_in_the_pool_is_not_handed_out() -> None:
    server, url, seen = await _scripted([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"] * 2)
    pool = UpstreamPool()
    assert await _exchange(pool, url) == (200, b"ok")
    (conn,) = pool._open
    conn.transport.close()  # as the loop does on the peer's close, a turn before it says so
    assert await _exchange(pool, url) == (200, b"ok")  # on a new connection
    assert seen["connections"] == 2
    server.close()
    await pool.close()
