"""The balancer's cell policy (pure) and its process pieces in-process: a cell's published
aggregate, the balancer reading it from polls and headers, early shedding, and its metrics."""

from __future__ import annotations

import asyncio

import random
from collections import Counter

import orjson
import pytest

from batcher.fleet.balancer.policy import (
    BalancerConfig,
    CellView,
    cell_saturation,
    choose_cell,
    effective_saturation,
    home_cell,
    retry_after,
)
from batcher.fleet.balancer.app import BalancerContext, create_balancer_app
from batcher.fleet.router.cell_state import StateHeader
from batcher.fleet.router.context import RouterConfig, RouterContext
from batcher.fleet.router.proxy import create_router_app

CFG = BalancerConfig()


def cells(*sats: float) -> list[CellView]:
    return [CellView(f"c{i}", s, healthy_replicas=4) for i, s in enumerate(sats)]


def test_saturation_is_the_largest_pressure() -> None:
    assert cell_saturation(100, 100, 0, 2, 0.0, CFG) == 0.0
    assert cell_saturation(25, 100, 0, 2, 0.0, CFG) == pytest.approx(0.75)  # KV
    assert cell_saturation(100, 100, 8, 2, 0.0, CFG) == pytest.approx(0.5)  # queue per replica
    assert cell_saturation(100, 100, 0, 2, 1.5, CFG) == pytest.approx(0.75)  # predicted wait
    assert cell_saturation(100, 100, 99, 2, 0.0, CFG) == 1.0  # capped
    assert cell_saturation(100, 100, 0, 0, 0.0, CFG) == 1.0  # no healthy replica


def test_a_tenant_stays_home_while_home_has_headroom() -> None:
    cs = cells(0.1, 0.1, 0.1, 0.1)
    rng = random.Random(1)
    homes = Counter(home_cell(cs, f"tenant-{i}").cell_id for i in range(400))
    assert len(homes) == 4 and min(homes.values()) > 60  # tenants spread over cells
    for i in range(50):
        t = f"tenant-{i}"
        picks = {choose_cell(cs, t, CFG, rng).cell_id for _ in range(20)}
        assert picks == {home_cell(cs, t).cell_id}
    # Even when another cell is emptier: home wins below shift_at (its prefix caches are warm).
    home = home_cell(cs, "tenant-0").cell_id
    skewed = [CellView(c.cell_id, 0.7 if c.cell_id == home else 0.0, healthy_replicas=4)
              for c in cs]
    assert choose_cell(skewed, "tenant-0", CFG, rng).cell_id == home


def test_shift_before_saturation_then_shed() -> None:
    rng = random.Random(2)
    cs = cells(0.1, 0.3, 0.5)
    t = next(f"t{i}" for i in range(100) if home_cell(cs, f"t{i}").cell_id == "c2")
    hot = [CellView("c0", 0.1, healthy_replicas=4), CellView("c1", 0.3, healthy_replicas=4),
           CellView("c2", CFG.shift_at, healthy_replicas=4)]
    picks = Counter(choose_cell(hot, t, CFG, rng).cell_id for _ in range(600))
    # Past shift_at the home cell is only one of the two choices, and it loses both duels.
    assert picks["c2"] == 0 and picks["c0"] > picks["c1"] > 0
    full = cells(0.96, 0.99, 1.0)
    assert choose_cell(full, t, CFG, rng) is None
    assert retry_after(full, CFG) >= 1
    down = [CellView("c0", 0.0, routable=False), CellView("c1", 0.0, routable=False)]
    assert choose_cell(down, t, CFG, rng) is None and retry_after(down, CFG) == 5


def test_two_choices_prefer_the_less_saturated_and_honour_exclude() -> None:
    rng = random.Random(3)
    cs = cells(0.0, 0.5, 0.9)
    picks = Counter(choose_cell(cs, None, CFG, rng).cell_id for _ in range(900))
    # c0 wins both of its duels, c1 one of two, c2 none: 2/3, 1/3, 0.
    assert picks["c2"] == 0 and 500 < picks["c0"] < 700
    assert choose_cell(cs, None, CFG, rng, exclude={"c0", "c1"}).cell_id == "c2"
    assert choose_cell(cs, None, CFG, rng, exclude={"c0", "c1", "c2"}) is None


def test_own_requests_count_until_the_cell_reports_them() -> None:
    c = CellView("c0", 0.5, healthy_replicas=2, unreflected=0.7)
    assert effective_saturation(c, CFG) == pytest.approx(1.0)
    assert effective_saturation(CellView("c0", 0.5, healthy_replicas=2, unreflected=0.25),
                                CFG) == pytest.approx(0.75)
    assert effective_saturation(CellView("c0", 0.1, healthy_replicas=0), CFG) == 1.0


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        BalancerConfig(shift_at=0.9, shed_at=0.8).validate()
    with pytest.raises(ValueError):
        BalancerConfig(waiting_full=0).validate()


def state(free: int, total: int, waiting: int = 0, **extra: object) -> dict[str, object]:
    return {"free_blocks": free, "total_blocks": total, "block_size": 16, "running": 1,
            "waiting": waiting, "version": "v1", "draining": False, "healthy": True, **extra}


async def test_a_router_publishes_its_aggregate(aiohttp_client) -> None:
    ctx = RouterContext(RouterConfig())
    for i, (free, waiting) in enumerate(((50, 0), (10, 4))):
        ctx.registry.add_static(f"http://r{i}:1", f"r{i}")
        assert ctx.registry.observe(f"r{i}", state(free, 100, waiting), ctx.clock(), poll=True)
    client = await aiohttp_client(create_router_app(ctx))
    resp = await client.get("/v1/state")
    body = await resp.json()
    assert body["free_blocks"] == 60 and body["total_blocks"] == 200 and body["waiting"] == 4
    assert body["healthy_replicas"] == 2 and body["healthy"] is True
    assert body["saturation"] == pytest.approx(max(0.7, 4 / 16, body["predicted_wait_s"] / 2))
    assert body["predicted_wait_s"] >= 0.0
    # Answers to forwarded requests carry it too (here a 400 the router gives itself).
    resp = await client.post("/v1/completions", data=b"[1]")
    assert resp.status == 400
    header = orjson.loads(resp.headers["X-Replica-State"])
    assert header["saturation"] == body["saturation"] and "weights" not in header
    text = await (await client.get("/metrics")).text()
    assert f'batcher_cell_saturation{{cell="local"}} {body["saturation"]}' in text
    assert "batcher_fleet_kv_free_blocks 60.0" in text
    assert "batcher_fleet_healthy_replicas 2.0" in text
    ctx.registry.get("r1").evicted = True
    body = await (await client.get("/v1/state")).json()
    assert body["healthy_replicas"] == 1 and body["total_blocks"] == 100


def header_seen_at_50_free_now_20() -> tuple[RouterContext, list[float], StateHeader]:
    """A state header over one replica: computed at 50 free blocks (time 0, max age 20 ms), the
    replica has since reported 20."""
    ctx = RouterContext(RouterConfig())
    ctx.registry.add_static("http://r0:1", "r0")
    assert ctx.registry.observe("r0", state(50, 100), ctx.clock(), poll=True)
    now = [0.0]
    header = StateHeader(ctx, max_age=0.02, clock=lambda: now[0])
    assert orjson.loads(header.value())["free_blocks"] == 50
    assert ctx.registry.observe("r0", state(20, 100), ctx.clock() + 1, poll=True)
    return ctx, now, header


async def test_the_state_header_is_shared_for_its_max_age_then_recomputed_after() -> None:
    ctx, now, header = header_seen_at_50_free_now_20()
    now[0] = 0.019
    assert orjson.loads(header.value())["free_blocks"] == 50  # one computation, shared
    now[0] = 0.02
    # The answer that finds it old does not wait for the computation: the next one sees it.
    assert orjson.loads(header.value())["free_blocks"] == 50
    assert orjson.loads(header.value())["free_blocks"] == 50  # one recomputation queued
    await asyncio.sleep(0)
    assert orjson.loads(header.value())["free_blocks"] == 20
    now[0] = 0.05
    assert ctx.registry.observe("r0", state(10, 100), ctx.clock() + 2, poll=True)
    await asyncio.sleep(0)
    assert orjson.loads(header.value())["free_blocks"] == 20
    await asyncio.sleep(0)
    assert orjson.loads(header.value())["free_blocks"] == 10
    # After a quiet spell (5 max ages) the answer that finds it so old waits for a fresh one.
    assert ctx.registry.observe("r0", state(5, 100), ctx.clock() + 3, poll=True)
    now[0] = 0.05 + 5 * 0.02
    assert orjson.loads(header.value())["free_blocks"] == 5


def test_without_a_loop_the_state_header_is_recomputed_at_once() -> None:
    _, now, header = header_seen_at_50_free_now_20()
    now[0] = 0.02
    assert orjson.loads(header.value())["free_blocks"] == 20


def test_the_state_header_is_ascii_whatever_the_version_label() -> None:
    ctx = RouterContext(RouterConfig())
    ctx.registry.add_static("http://r0:1", "r0")
    assert ctx.registry.observe("r0", state(50, 100, version="café"), ctx.clock(), poll=True)
    text = StateHeader(ctx).value()
    assert text.isascii() and orjson.loads(text)["version"] == "café"


async def test_balancer_reads_cells_and_sheds_early(aiohttp_client) -> None:
    ctx = BalancerContext(RouterConfig(), BalancerConfig())
    for i in range(2):
        ctx.registry.add_static(f"http://c{i}:1", f"c{i}")
    now = ctx.clock()
    # A cell that publishes saturation is taken at its word; one that does not is judged by
    # its contract figures.
    ctx.registry.observe("c0", state(100, 100, saturation=0.97, healthy_replicas=3), now,
                         poll=True)
    ctx.registry.observe("c1", state(2, 100), now, poll=True)
    views = {v.cell_id: v for v in ctx.views()}
    assert views["c0"].saturation == 0.97 and views["c0"].healthy_replicas == 3
    assert views["c1"].saturation == pytest.approx(0.98)
    client = await aiohttp_client(create_balancer_app(ctx))
    body = {"model": "fake", "prompt": "hello", "max_tokens": 4}
    resp = await client.post("/v1/completions", data=orjson.dumps(body),
                             headers={"Authorization": "Bearer k", "X-Request-Id": "mine"})
    assert resp.status == 503 and int(resp.headers["Retry-After"]) >= 1
    assert resp.headers["X-Request-Id"] == "mine"
    err = (await resp.json())["error"]
    assert err["code"] == "overloaded" and set(err) == {"message", "type", "param", "code"}
    text = await (await client.get("/metrics")).text()
    assert 'batcher_cell_saturation{cell="c0"} 0.97' in text
    assert text.count("batcher_cell_saturation{") == 2  # its cells, not a router's own
    assert 'batcher_cell_healthy_replicas{cell="c0"} 3.0' in text
    assert "batcher_fleet_kv_total_blocks 200.0" in text
    # With headroom back in one cell, the same request is no longer shed at the door (it then
    # fails to connect to the made-up address, and the relay's own 503 says so).
    ctx.registry.observe("c1", state(90, 100, saturation=0.1), ctx.clock(), poll=True)
    assert ctx.shed_now() is None
    assert ctx.pick(10, "scope\x00hello", set()).replica_id == "c1"
    assert ctx.pick(10, None, {"c1"}) is None  # c0 is past shed_at
