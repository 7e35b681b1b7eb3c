"""`batcher fleet`: replicas on loopback ports behind the router, supervised and restarted."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import aiohttp
import pytest

from batcher.app.fleet_cli import add_fleet_args, serve_flags
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
    """Running (a zombie waiting for a reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.slow
async def test_fleet_launches_supervises_and_restarts():
    port, admin_port = free_port(), free_port()
    fleet = Proc(["-m", "batcher.app.fleet_cli", "fleet", "--replicas", "2", "--restart", *FAKE,
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
            # The router saw it go: evicted, or (when the restart came within `evict_after`
            # health rounds) at least its failed liveness checks.
            assert view["health"]["evictions"] >= 1 or "/health" in view["health"]["last_error"]
            # Heartbeats (with the fleet key the launcher made) reach the router.
            assert all(r["epoch"] is not None and r["seq"] >= 1 for r in st["replicas"])
            assert (await completion(s, fleet.url, "again", 4))[0] == 200
            pids = [p["pid"] for p in st["processes"]]
        assert fleet.stop(timeout=20) == 0
    assert not any(alive(pid) for pid in pids)


@pytest.mark.slow
async def test_replicas_die_with_a_killed_launcher():
    """`kill -9` of `batcher fleet` gives it no chance to stop anything: the replicas must still
    go (the kernel signals them), or they would keep heartbeating and holding their memory."""
    port, admin_port = free_port(), free_port()
    fleet = Proc(["-m", "batcher.app.fleet_cli", "fleet", "--replicas", "2", *FAKE,
                  "--num-blocks", "64", "--port", str(port), "--admin-port", str(admin_port),
                  "--admin-key", ADMIN_KEY, "--shutdown-timeout", "2"], port, "fleet",
                 admin_port)
    with running(fleet):
        wait_http(fleet.url + "/health", procs=(fleet,))
        async with aiohttp.ClientSession() as s:
            await wait_routable(s, fleet, 2, timeout=60)
            pids = [p["pid"] for p in (await admin(s, fleet, "/admin/status"))["processes"]]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
        fleet.signal(signal.SIGKILL)
        fleet.p.wait(10)
        deadline = time.monotonic() + 15  # SIGTERM: each drains (nothing running) and exits
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        left = [pid for pid in pids if alive(pid)]
        for pid in left:  # never leave them behind, whatever the verdict
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        print(f"launcher killed: replicas gone in {15 - (deadline - time.monotonic()):.1f}s")
        assert not left, f"replicas {left} outlived their launcher"


def test_a_router_taking_heartbeats_off_loopback_has_a_fleet_key(tmp_path, capsys):
    import argparse

    from batcher.app.fleet_cli import add_router_args, ensure_fleet_key, fleet_key, router_config
    from batcher.fleet.router.context import RouterContext
    from batcher.fleet.launcher import serve_router

    p = argparse.ArgumentParser()
    add_router_args(p)
    key_file = tmp_path / "fleet.key"
    key_file.write_text("from-a-file\n")
    args = p.parse_args(["--fleet-key-file", str(key_file), "--fleet-key", "ignored"])
    assert fleet_key(args) == "from-a-file"
    for host, generated in (("127.0.0.1", False), ("::1", False), ("0.0.0.0", True)):
        cfg = router_config(p.parse_args(["--internal-host", host]))
        cfg.fleet_key = None  # whatever the environment holds
        ensure_fleet_key(cfg, host)
        assert (cfg.fleet_key is not None) == generated
        if generated:
            assert len(cfg.fleet_key) == 32 and cfg.fleet_key in capsys.readouterr().out
    cfg = router_config(p.parse_args([]))
    cfg.fleet_key = None
    with pytest.raises(SystemExit, match="fleet key"):
        asyncio.run(serve_router(RouterContext(cfg), "127.0.0.1", free_port(),
                                 internal_port=free_port(), internal_host="0.0.0.0"))


def test_ports_for_servers_come_from_below_the_ephemeral_range_and_never_twice() -> None:
    """Outgoing connections take their local ports from the ephemeral range: a port picked there
    could be taken before the server it is meant for binds it."""
    import socket

    from batcher.fleet.launcher import PICK_FROM, ephemeral_range

    lo, _ = ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    if lo - PICK_FROM >= 1024:
        assert all(PICK_FROM <= p < lo for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free as handed out
