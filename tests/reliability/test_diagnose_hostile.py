"""`batcher diagnose` against hostile or broken targets prints one bounded, printable reason.

Pass figures: a target whose /metrics is 200 KB of garbage with control characters, one that
answers 500 with 200 KB, and one that never answers each make `batcher diagnose --window 0
--timeout 1` exit 1 within 10 s with one stderr line under 600 characters, free of control
characters; the hanging one's line says it timed out.

The targets are in-process HTTP servers on 127.0.0.1; diagnose runs as a real process.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
from aiohttp import web

from tests.fleet.procs import free_port
from tests.server_process import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

GARBAGE = "\x1b[31m" + "x" * 200_000 + "\r\n\x07bell"


async def _target(handler: web.RequestHandler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/metrics", handler)
    app.router.add_get("/v1/state", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def _diagnose(url: str) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "batcher.app.cli", "diagnose", url, "--window", "0", "--timeout", "1",
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode or 0, err.decode(errors="replace"), time.monotonic() - start


async def test_diagnose_prints_bounded_reasons() -> None:
    async def garbage(request: web.Request) -> web.Response:
        return web.Response(text=GARBAGE)

    async def error(request: web.Request) -> web.Response:
        return web.Response(status=500, text=GARBAGE)

    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(4)  # past --timeout; short, so the server stops soon after
        return web.Response(text="")

    for handler, expect in ((garbage, None), (error, "500"), (hang, "timed out")):
        runner, url = await _target(handler)
        try:
            code, err, took = await _diagnose(url)
        finally:
            await runner.cleanup()
        lines = err.strip().splitlines()
        assert code == 1, (handler.__name__, code, err[:500])
        assert took < 10, (handler.__name__, took)
        assert len(lines) == 1 and len(lines[0]) < 600, (handler.__name__, len(err), err[:300])
        assert lines[0].isprintable(), (handler.__name__, lines[0][:300])
        assert expect is None or expect in lines[0], (handler.__name__, lines[0])
        assert not lines[0].rstrip().endswith(":"), (handler.__name__, lines[0])
