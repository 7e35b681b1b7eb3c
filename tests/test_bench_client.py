"""The load client against servers that close kept-alive connections: a request on a connection
the server already closed is sent again once on a new one; a server that drops every request is
still an error."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from batcher.bench.client import ClientConfig, send_request
from batcher.bench.workload import BenchRequest

_CHUNK = orjson.dumps({"choices": [{"text": "hi", "finish_reason": "length"}],
                       "usage": {"completion_tokens": 1}})
_BODY = b"data: " + _CHUNK + b"\n\ndata: [DONE]\n\n"


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 per_connection: int) -> None:
    # Answers `per_connection` requests, then closes the connection when the next one arrives,
    # without "Connection: close" (as a server whose keep-alive ended does).
    try:
        for _ in range(per_connection):
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(_BODY) + _BODY)
            await writer.drain()
        await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()


async def _run(per_connection: int, n: int) -> list:
    server = await asyncio.start_server(lambda r, w: _serve(r, w, per_connection),
                                        "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cfg = ClientConfig(base_url=f"http://127.0.0.1:{port}", model="m")
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return [await send_request(session, cfg, BenchRequest(f"r{i}", [1, 2, 3], None, 1), 0.0)
                    for i in range(n)]
    finally:
        server.close()
        await server.wait_closed()


async def test_a_closed_kept_alive_connection_is_replaced_once() -> None:
    results = await asyncio.wait_for(_run(per_connection=1, n=4), 30)
    assert [r.kind for r in results] == ["ok"] * 4, [r.error for r in results]
    assert [r.reconnected for r in results] == [False, True, True, True]


async def test_a_server_that_drops_every_request_is_an_error() -> None:
    results = await asyncio.wait_for(_run(per_connection=0, n=2), 30)
    assert [r.kind for r in results] == ["connection"] * 2
    assert all(r.reconnected for r in results)  # tried twice each, no more
