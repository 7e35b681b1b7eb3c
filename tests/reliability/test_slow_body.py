"""Bodies sent slowly are cut off on every listener that reads them: replica, router, its admin
listener, and a balancer over the router.

Pass figure: connections that announce `Content-Length: 1000000` and then send a byte every 0.5 s
are answered 408 (or closed) within the body timeout (2 s here, plus 1 MB at 256 KiB/s: 5.8 s),
at most 12 s after connecting (slack for a loaded machine); `/health` of each keeps answering
within 3 s meanwhile; nothing is logged as a traceback.

A fake replica (no tenants, so anonymous bodies are read), a router and a balancer on 127.0.0.1,
started and stopped by this module, each with `BATCHER_BODY_TIMEOUT=2`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from tests.fleet.procs import ADMIN_KEY, Proc, free_port, router, running, wait_http
from tests.reliability.conftest import FAKE
from tests.server_process import Server, serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ENV = {"BATCHER_BODY_TIMEOUT": "2"}
BOUND_S = 12.0
PER_LISTENER = 6


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Server, Proc, Proc]]:
    with serve(*FAKE, admin_key=ADMIN_KEY, env=ENV) as rep:
        rt = router("--log-level", "info", replicas=(f"{rep.url},{rep.admin_url}",), env=ENV)
        port = free_port()
        top = Proc(["-m", "batcher.app.cli", "balancer", f"--cell={rt.url}", "--cell-key",
                    ADMIN_KEY, "--port", str(port), "--log-level", "info"], port, "balancer",
                   env=ENV)
        with running(top, rt):
            wait_http(rt.url + "/health", procs=(rt,))
            wait_http(top.url + "/health", procs=(top,))
            yield rep, rt, top
            for p in (rt, top):
                assert "Traceback" not in p.tail(100_000), p.tail()


async def _trickle(url: str, path: str, headers: str = "") -> tuple[float, bytes]:
    """Announce a 1 MB body, then send a byte every 0.5 s until the server answers or hangs up;
    give up after BOUND_S + 3 s."""
    host, _, port = url.removeprefix("http://").partition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    start, got = time.monotonic(), b""
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: 1000000\r\n{headers}\r\n".encode())
    try:
        while time.monotonic() - start < BOUND_S + 3:
            writer.write(b" ")
            await writer.drain()
            try:
                chunk = await asyncio.wait_for(reader.read(4096), 0.5)
            except TimeoutError:
                continue
            got += chunk
            if not chunk:  # closed
                break
    except ConnectionError:
        pass
    finally:
        writer.close()
    return time.monotonic() - start, got


async def _health_worst(urls: list[str], stop: asyncio.Event) -> float:
    import aiohttp

    worst = 0.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        while not stop.is_set():
            for url in urls:
                start = time.monotonic()
                async with s.get(url + "/health") as resp:
                    assert resp.status == 200
                worst = max(worst, time.monotonic() - start)
            await asyncio.sleep(0.1)
    return worst


async def test_slow_bodies_are_cut_off_everywhere(fleet: tuple[Server, Proc, Proc]) -> None:
    rep, rt, top = fleet
    admin = f"Authorization: Bearer {ADMIN_KEY}\r\n"
    targets = [(rep.url, "/v1/completions", ""), (rt.url, "/v1/completions", ""),
               (top.url, "/v1/completions", ""), (str(rt.admin_url), "/admin/weights", admin)]
    stop = asyncio.Event()
    watcher = asyncio.create_task(_health_worst([rep.url, rt.url, top.url], stop))
    try:
        results = await asyncio.gather(*(
            _trickle(url, path, head) for url, path, head in targets
            for _ in range(PER_LISTENER)))
    finally:
        stop.set()
    worst = await watcher
    for i, (took, got) in enumerate(results):
        where = targets[i // PER_LISTENER][:2]
        assert took < BOUND_S, f"{where}: still open after {took:.1f} s ({got[:80]!r})"
        # 408 once the body's deadline passes, or closed; a balancer that sees every cell
        # saturated (its cells' state not in yet) sheds at once with a 503 before reading
        # the body, which frees the connection as well.
        ok = (b"HTTP/1.1 408", b"HTTP/1.1 503") if where[0] == top.url else (b"HTTP/1.1 408",)
        assert got == b"" or got.startswith(ok), (where, got[:200])
    assert worst < 3.0, f"/health took {worst:.2f} s meanwhile"
