"""The router's internal and admin listeners in-process (`aiohttp_client`, no subprocess):
heartbeat keys, identity binding, the replica cap, per-source limits, and the admin key check. Milliseconds each; `tests/reliability/test_security_router.py` runs the
same claims against real processes."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from batcher.fleet.router.admin import create_admin_app
from batcher.fleet.router.context import RouterConfig, RouterContext
from batcher.fleet.router.internal import create_internal_app

FLEET = "fleet-key-in-process"
ADMIN = "admin-key-in-process"


def beat(rid: str, url: str, epoch: int = 1, seq: int = 1, **extra: object) -> bytes:
    return orjson.dumps({"free_blocks": 10, "total_blocks": 10, "block_size": 16, "running": 0,
                         "waiting": 0, "version": "v1", "draining": False, "healthy": True,
                         "replica_id": rid, "url": url, "epoch": epoch, "seq": seq, **extra})


@pytest.fixture
def ctx() -> RouterContext:
    return RouterContext(RouterConfig(fleet_key=FLEET, max_replicas=3, beats_per_source=1.0,
                                      beat_burst=5))


async def test_beats_need_the_key_and_cannot_repoint(aiohttp_client, ctx) -> None:
    client = await aiohttp_client(create_internal_app(ctx))
    key = {"Authorization": f"Bearer {FLEET}"}
    resp = await client.post("/internal/heartbeat", data=beat("r0", "http://a:1"))
    assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
    resp = await client.post("/internal/heartbeat", headers=key, data=beat(
        "r0", "http://a:1", admin_url="http://a:2"))
    assert resp.status == 200 and (await resp.json()) == {"accepted": True}
    assert ctx.registry.get("r0").admin_url == "http://a:2"  # announced with the key
    resp = await client.post("/internal/heartbeat", headers=key,
                             data=beat("r0", "http://evil:1", epoch=2))
    assert resp.status == 409
    assert ctx.registry.get("r0").url == "http://a:1"
    resp = await client.post("/internal/heartbeat", headers={"Authorization": "bearer " + FLEET},
                             data=b"[]")
    assert resp.status == 400  # the scheme in any case; then the body is checked


async def test_cap_and_rate_limit(aiohttp_client, ctx) -> None:
    client = await aiohttp_client(create_internal_app(ctx))
    key = {"Authorization": f"Bearer {FLEET}"}
    statuses = []
    for i in range(7):
        resp = await client.post("/internal/heartbeat", headers=key,
                                 data=beat(f"r{i}", f"http://h{i}:1"))
        statuses.append(resp.status)
    # Three fit under the cap, two more are refused by it; the burst of five is then spent.
    assert statuses == [200, 200, 200, 503, 503, 429, 429], statuses
    assert len(ctx.registry) == 3
    # Beats without the key have a bucket of their own: the flood above did not spend it.
    resp = await client.post("/internal/heartbeat", data=beat("x", "http://x:1"))
    assert resp.status == 401


async def test_admin_key_checks_never_raise(aiohttp_client, ctx) -> None:
    client = await aiohttp_client(create_admin_app(ctx, ADMIN))
    # (Non-UTF-8 bytes need a raw socket: the process suite sends them.)
    for value in ("", "Bearer", f"Basic {ADMIN}", f"Bearer {ADMIN}x", f"Bearer {ADMIN} x"):
        resp = await client.get("/admin/status", headers={"Authorization": value})
        assert resp.status == 401, value
    resp = await client.get("/admin/status", headers={"Authorization": f"bearer {ADMIN}"})
    assert resp.status == 200 and (await resp.json())["replicas"] == []
    resp = await client.post("/admin/drain", headers={"Authorization": f"Bearer {ADMIN}"},
                             data=orjson.dumps({"replica": "nope", "admin_url": "http://evil"}))
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "replica_not_found"
    resp = await client.post("/admin/canary", headers={"Authorization": f"Bearer {ADMIN}"},
                             data=b'{"version": "v2", "weight": 2}')
    assert resp.status == 400


async def test_bookkeeping_runs_after_in_order_and_one_failure_drops_nothing(caplog) -> None:
    ctx = RouterContext(RouterConfig())
    seen: list[int] = []

    def boom() -> None:
        raise RuntimeError("bad record")

    ctx.later(seen.append, 1)
    ctx.later(boom)
    ctx.later(seen.append, 2)
    assert seen == []  # nothing before the loop's next turn
    await asyncio.sleep(0)
    assert seen == [1, 2] and "router bookkeeping failed" in caplog.text
    ctx.later(seen.append, 3)  # a new batch after the last ran
    await asyncio.sleep(0)
    assert seen == [1, 2, 3]


def test_bookkeeping_without_a_loop_runs_at_once() -> None:
    ctx = RouterContext(RouterConfig())
    seen: list[int] = []
    ctx.later(seen.append, 1)
    assert seen == [1]
