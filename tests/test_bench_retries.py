"""`batcher bench --retries`: a request refused with 429/503 is sent again after the server's
Retry-After, up to the bound, as OpenAI's client does; without retries each refusal counts."""

from __future__ import annotations

import asyncio
import time
from email.utils import formatdate

import aiohttp
import orjson
import pytest

from batcher.bench.client import ClientConfig, retry_delay, send_request
from batcher.bench.report import summarize
from batcher.bench.workload import BenchRequest

_CHUNK = orjson.dumps({"choices": [{"text": "hi", "finish_reason": "length"}],
                       "usage": {"completion_tokens": 1}})
_OK = b"data: " + _CHUNK + b"\n\ndata: [DONE]\n\n"
_BUSY = orjson.dumps({"error": {"message": "queue full", "type": "service_unavailable"}})


async def _run(refusals: int, max_retries: int, n: int = 3):
    """A server that refuses its first `refusals` requests (503 or 429 in turn, Retry-After 0)."""
    seen = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                seen[0] += 1
                if seen[0] <= refusals:
                    status = b"503 Service Unavailable" if seen[0] % 2 else b"429 Too Many"
                    writer.write(b"HTTP/1.1 " + status + b"\r\nRetry-After: 0\r\n"
                                 b"Content-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n" % len(_BUSY) + _BUSY)
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                 b"Content-Length: %d\r\n\r\n" % len(_OK) + _OK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cfg = ClientConfig(f"http://127.0.0.1:{port}", "m", max_retries=max_retries,
                       request_timeout=30)
    try:
        async with aiohttp.ClientSession() as session:
            return [await send_request(session, cfg, BenchRequest(f"r{i}", [1, 2], None, 1), 0.0)
                    for i in range(n)]
    finally:
        server.close()
        await server.wait_closed()


async def test_refused_requests_are_sent_again_after_retry_after() -> None:
    results = await asyncio.wait_for(_run(refusals=4, max_retries=4), 30)
    assert [r.kind for r in results] == ["ok"] * 3, [r.error for r in results]
    assert [r.attempts for r in results] == [5, 1, 1]
    s = summarize(results)
    assert s["ok"] == 3 and s["retried"] == 1 and s["retries"] == 4


async def test_retries_are_bounded() -> None:
    results = await asyncio.wait_for(_run(refusals=10, max_retries=2, n=2), 30)
    assert [r.kind for r in results] == ["503", "429"]
    assert [r.attempts for r in results] == [3, 3]
    assert all(r.retry_after == "0" for r in results)


async def test_without_retries_each_refusal_counts() -> None:
    results = await asyncio.wait_for(_run(refusals=1, max_retries=0, n=2), 30)
    assert [r.kind for r in results] == ["503", "ok"]
    assert summarize(results)["retried"] == 0


def test_retry_delay_honours_the_header_and_backs_off_without_it() -> None:
    assert retry_delay("3", 1) == 3.0
    assert retry_delay("0.25", 5) == 0.25
    assert 4.0 <= retry_delay(formatdate(time.time() + 6, usegmt=True), 1) <= 6.0
    # No header, one past the minute or nonsense: the SDK's backoff, jittered down by <= 25 %.
    assert retry_delay(None, 1, rand=0.0) == 0.5
    assert retry_delay(None, 3, rand=1.0) == 2.0 * 0.75
    assert retry_delay("3600", 10, rand=0.0) == 8.0
    assert retry_delay("soon", 2, rand=0.0) == 1.0


def test_negative_retries_are_refused() -> None:
    with pytest.raises(ValueError, match="retries"):
        ClientConfig("http://x", "m", max_retries=-1)
