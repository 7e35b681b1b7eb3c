"""Cells over real processes: `batcher fleet --cells 2 --replicas 2 --model fake`, one cell's router
killed (SIGKILL) mid-run. Every request that had streamed nothing is retried in the other cell;
streams already under way resume there; none is lost. Then the dead cell is out of rotation and a
drained cell gets no new work."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from tests.fleet.procs import (
    ADMIN_KEY,
    FAKE,
    Proc,
    admin,
    completion,
    free_port,
    router,
    router_samples,
    running,
    stream,
    stream_text,
    wait_http,
    wait_routable,
)

pytestmark = pytest.mark.slow
N = 48
TOKENS = 30


def cells_fleet() -> Proc:
    port, admin_port = free_port(), free_port()
    argv = ["-m", "batcher.app.cli", "fleet", "--cells", "2", "--replicas", "2", *FAKE,
            "--fake-decode-step-ms", "10", "--port", str(port), "--admin-port",
            str(admin_port), "--admin-key", ADMIN_KEY, "--shutdown-timeout", "3",
            # A cell's death moves its share of the requests in flight at once: the budget
            # must cover that share (half of them here), not a trickle.
            "--retry-ratio", "0.5"]
    return Proc(argv, port, "cells", admin_port)


async def test_a_cell_router_killed_mid_run_loses_nothing():
    top = cells_fleet()
    with running(top):
        wait_http(top.url + "/health", procs=(top,))
        async with aiohttp.ClientSession() as s:
            await wait_routable(s, top, 2, timeout=150.0)
            status = await admin(s, top, "/admin/status")
            pids = {p["replica_id"]: p["pid"] for p in status["processes"]}
            tenants = [aiohttp.ClientSession(headers={"Authorization": f"Bearer tenant-{k}"})
                       for k in range(6)]
            gate = asyncio.Semaphore(8)
            done = [0]

            async def one(i: int):
                async with gate:
                    # Several tenants (keys), so both cells are some tenant's home.
                    t = tenants[i % len(tenants)]
                    if i % 3 == 2:
                        out = await stream(t, top.url, f"request {i}", TOKENS, rid=f"id-{i}",
                                           failover="resume")
                    else:
                        out = await completion(t, top.url, f"request {i}", TOKENS,
                                               rid=f"id-{i}")
                    done[0] += 1
                    return i, out

            tasks = [asyncio.create_task(one(i)) for i in range(N)]
            while done[0] < 10:
                await asyncio.sleep(0.02)
            victim = "c0"
            os.kill(pids[victim], signal.SIGKILL)
            try:
                results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            finally:
                for t in tenants:
                    await t.close()
            for i, (code, body) in results:
                assert code == 200, (i, body)
                if i % 3 == 2:
                    assert body[-1] == "[DONE]", (i, body[-2:])
                    assert not any(isinstance(e, dict) and "error" in e for e in body), i
                    assert len(stream_text(body)) > 0
                else:
                    assert body["usage"]["completion_tokens"] == TOKENS, (i, body)
            retries = sum(v for _, v in await router_samples(s, top, "batcher_retries_total"))
            failovers = await router_samples(s, top, "batcher_failovers_total")
            assert retries + sum(v for _, v in failovers) >= 1  # the kill hit work in flight
            # The dead cell leaves rotation; the other takes everything.
            deadline = time.monotonic() + 10
            view = {}
            while time.monotonic() < deadline:
                view = {c["replica_id"]: c for c in (await admin(s, top, "/admin/status"))
                        ["replicas"]}
                if not view[victim]["routable"]:
                    break
                await asyncio.sleep(0.1)
            assert not view[victim]["routable"]
            sat = {lab["cell"]: v for lab, v in
                   await router_samples(s, top, "batcher_cell_saturation")}
            assert sat[victim] == 1.0 and sat["c1"] < 1.0
            # Drain the survivor: new work is shed at the door with 503 + Retry-After.
            await admin(s, top, "/admin/drain", {"replica": "c1"})
            async with s.post(f"{top.url}/v1/completions", json={
                    "model": "fake", "prompt": "x", "max_tokens": 2}) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"]
                assert (await resp.json())["error"]["code"] == "overloaded"




async def test_balancer_over_two_routers_on_the_bundled_model():
    """`batcher balancer --cell URL` at default settings on the bundled model: two cell routers
    (here sharing one replica, so one model load) behind one balancer."""
    rport = free_port()
    rep = Proc(["-m", "batcher.app.cli", "serve", "--embedding-model", "none", "--port", str(rport),
                "--log-level", "warning", "--shutdown-timeout", "3"], rport, "bundled")
    cells = [router(replicas=(rep,)) for _ in range(2)]
    port, admin_port = free_port(), free_port()
    top = Proc(["-m", "batcher.app.cli", "balancer", *(f"--cell={c.url}" for c in cells),
                "--cell-key", ADMIN_KEY, "--port", str(port), "--admin-port", str(admin_port),
                "--admin-key", ADMIN_KEY, "--log-level", "warning"], port, "balancer",
               admin_port)
    with running(top, *cells, rep):
        wait_http(rep.url + "/ready", timeout=240.0, procs=(rep,))
        async with aiohttp.ClientSession() as s:
            await wait_routable(s, top, 2, timeout=60.0)
            code, body = await completion(s, top.url, "The capital of France is", 4,
                                          model="smollm2-135m")
            assert code == 200 and body["usage"]["completion_tokens"] == 4, body
            async with s.get(f"{top.url}/v1/state") as resp:
                state = await resp.json()
            assert state["healthy"] and 0.0 <= state["saturation"] <= 1.0
            sat = {lab["cell"]: v for lab, v in
                   await router_samples(s, top, "batcher_cell_saturation")}
            assert len(sat) == 2 and all(0.0 <= v < 1.0 for v in sat.values()), sat
            async with s.get(f"{cells[0].url}/v1/state") as resp:
                cell = await resp.json()
            assert cell["healthy_replicas"] == 1 and "saturation" in cell
