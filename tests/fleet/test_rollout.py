"""Rollout over real replicas: canary by weight, promote, roll back, drain with no errors."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from tests.fleet.procs import (
    admin,
    completion,
    free_port,
    replica,
    router,
    router_samples,
    running,
    served_by,
    stream,
    wait_http,
    wait_routable,
)

pytestmark = pytest.mark.slow


async def by_version(s: aiohttp.ClientSession, rt) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, v in await router_samples(s, rt, "batcher_router_requests_total"):
        if labels["outcome"] == "ok":
            out[labels["version"]] = out.get(labels["version"], 0.0) + v
    return out


async def burst(s: aiohttp.ClientSession, url: str, n: int, tokens: int = 2) -> None:
    gate = asyncio.Semaphore(25)

    async def one(i: int) -> int:
        async with gate:
            return (await completion(s, url, f"p{i}", tokens))[0]

    statuses = await asyncio.gather(*(one(i) for i in range(n)))
    assert statuses == [200] * n


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}


async def test_canary_promote_rollback_and_drain():
    rt = router(port=free_port())
    stable = replica("stable", "--deployment-version", "v1", router=rt.internal_url, decode_ms=10)
    canary = replica("canary", "--deployment-version", "v2", router=rt.internal_url, decode_ms=10)
    with running(rt, stable, canary):
        wait_http(rt.url + "/health", procs=(rt,))
        async with aiohttp.ClientSession() as s:
            await wait_routable(s, rt, 2)
            assert (await admin(s, rt, "/admin/canary", {"version": "v2", "weight": 0.05})
                    )["weights"] == {"v2": 0.05, "*": 0.95}
            before = await by_version(s, rt)
            await burst(s, rt.url, 300)
            d = delta(await by_version(s, rt), before)
            assert 2 <= d["v2"] <= 33, d  # 5% of 300 = 15 (the exact figure: test_policy)

            await admin(s, rt, "/admin/promote", {"version": "v2"})
            before = await by_version(s, rt)
            await burst(s, rt.url, 20)
            assert delta(await by_version(s, rt), before).get("v1", 0) == 0

            await admin(s, rt, "/admin/rollback", {"version": "v2"})
            before = await by_version(s, rt)
            await burst(s, rt.url, 20)
            assert delta(await by_version(s, rt), before).get("v2", 0) == 0
            await admin(s, rt, "/admin/weights", {})

            # Drain the stable replica with streams in flight on it: nothing fails, new work
            # goes elsewhere, and it ends idle.
            streams = [asyncio.create_task(stream(s, rt.url, f"long {i}", 60))
                       for i in range(12)]
            while (await admin(s, rt, "/admin/replicas/stable"))["router_inflight"] < 2:
                await asyncio.sleep(0.02)
            # The admin URL is the one the replica announced with the fleet key.
            drained = await admin(s, rt, "/admin/drain", {"replica": "stable"})
            assert drained["router_draining"] and drained["replica_admin"] == {"status": 200}
            assert not drained["idle"]
            before = await served_by(s, rt)
            await burst(s, rt.url, 20)
            assert delta(await served_by(s, rt), before)["canary"] >= 20
            for status, events in await asyncio.gather(*streams):
                assert status == 200 and events[-1] == "[DONE]"
                assert events[-2]["choices"][0]["finish_reason"] == "length"
            deadline = time.monotonic() + 5
            while not (view := await admin(s, rt, "/admin/replicas/stable"))["idle"]:
                assert time.monotonic() < deadline, view
                await asyncio.sleep(0.05)
            assert view["draining"] and view["running"] == 0
            async with s.get(f"{stable.url}/ready") as resp:
                assert resp.status == 503  # the replica itself knows
            errors = [v for labels, v in await router_samples(
                s, rt, "batcher_router_client_requests_total") if labels["outcome"] != "ok"]
            assert sum(errors) == 0

            await admin(s, rt, "/admin/undrain", {"replica": "stable"})
            await wait_routable(s, rt, 2, timeout=5)
            async with s.post(f"{rt.admin_url}/admin/drain", data=orjson.dumps({"replica": "x"}),
                              headers={"Authorization": "Bearer wrong"}) as resp:
                assert resp.status == 401
