"""`batcher fleet`: replicas on loopback ports behind the router, supervised and restarted."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from batcher.fleet.cli import add_fleet_args, serve_flags
from tests.fleet.procs import (
    ADMIN_KEY,
    FAKE,
    Proc,
    admin,
    completion,
    free_port,
    running,
    wait_http,
    wait_routable,
)


def test_serve_flags_pass_only_changed_replica_flags():
    import argparse

    p = argparse.ArgumentParser()
    add_fleet_args(p)
    args = p.parse_args(["--replicas", "3", "--model", "fake", "--num-blocks", "300",
                         "--no-prefix-caching", "--port", "9000", "--admin-port", "9001"])
    flags = serve_flags(args)
    assert flags == ["--model", "fake", "--num-blocks", "300", "--no-prefix-caching"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
async def test_fleet_launches_supervises_and_restarts():
    port, admin_port = free_port(), free_port()
    fleet = Proc(["-m", "batcher.fleet.cli", "fleet", "--replicas", "2", "--restart", *FAKE,
                  "--num-blocks", "300", "--fake-decode-step-ms", "5", "--port", str(port),
                  "--admin-port", str(admin_port), "--admin-key", ADMIN_KEY,
                  "--shutdown-timeout", "3"], port, "fleet", admin_port)
    with running(fleet):
        wait_http(fleet.url + "/health", procs=(fleet,))
        async with aiohttp.ClientSession() as s:
            await wait_routable(s, fleet, 2, timeout=60)
            status, body = await completion(s, fleet.url, "hello", 4)
            assert status == 200 and body["choices"][0]["text"]
            async with s.get(f"{fleet.url}/v1/state") as resp:
                assert (await resp.json())["total_blocks"] == 600
            procs = (await admin(s, fleet, "/admin/status"))["processes"]
            pids = {p["replica_id"]: p["pid"] for p in procs}
            os.kill(pids["r0"], signal.SIGKILL)
            deadline = time.monotonic() + 40
            while True:
                st = await admin(s, fleet, "/admin/status")
                r0 = next(p for p in st["processes"] if p["replica_id"] == "r0")
                view = next(r for r in st["replicas"] if r["replica_id"] == "r0")
                if r0["restarts"] == 1 and r0["alive"] and view["routable"]:
                    break
                assert time.monotonic() < deadline, st
                await asyncio.sleep(0.2)
            assert r0["exit_codes"] == [-signal.SIGKILL] and r0["pid"] != pids["r0"]
            assert view["health"]["evictions"] >= 1
            # Heartbeats (with the fleet key the launcher made) reach the router.
            assert all(r["epoch"] is not None and r["seq"] >= 1 for r in st["replicas"])
            assert (await completion(s, fleet.url, "again", 4))[0] == 200
            pids = [p["pid"] for p in st["processes"]]
        assert fleet.stop(timeout=20) == 0
    assert not any(alive(pid) for pid in pids)
