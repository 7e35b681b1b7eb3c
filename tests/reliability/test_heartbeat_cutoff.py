"""A client that hangs up in the middle of a body costs one log line, not a traceback.

Pass figure: three heartbeats whose bodies are cut off by a closed connection are logged by the
router as one line each, with no traceback, and the router keeps taking beats.

One router on 127.0.0.1 (no replicas), started and stopped by this module.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import pytest

from tests.fleet.procs import FLEET_KEY, Proc, router, running, wait_http

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def rt() -> Iterator[Proc]:
    proc = router("--log-level", "info")
    with running(proc):
        wait_http(proc.url + "/health", procs=(proc,))
        yield proc


async def test_cut_off_heartbeat_is_one_line(rt: Proc) -> None:
    port = int(str(rt.internal_url).rsplit(":", 1)[1])
    for _ in range(3):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"POST /internal/heartbeat HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     f"Authorization: Bearer {FLEET_KEY}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 1000\r\n\r\n{{\"replica_id\": ".encode())
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
    deadline = time.monotonic() + 5
    while rt.tail(200_000).count("closed the connection") < 3:
        assert time.monotonic() < deadline, rt.tail()
        await asyncio.sleep(0.1)
    log = rt.tail(200_000)
    assert "Traceback" not in log, log
    async with aiohttp.ClientSession() as s, s.post(
            f"{rt.internal_url}/internal/heartbeat", data=b"[]",
            headers={"Authorization": f"Bearer {FLEET_KEY}"}) as resp:
        assert resp.status == 400  # still taking beats (this one is not an object)
