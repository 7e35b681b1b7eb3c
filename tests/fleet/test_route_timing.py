"""The router's `route` phase in front of the replica's phases: a replica and a router
in-process (`aiohttp_client`), whole answers and a stream's usage chunk."""

from __future__ import annotations

import json
import time

import orjson
import pytest

from batcher.fleet.context import RouterConfig, RouterContext
from batcher.fleet.proxy import create_router_app
from batcher.fleet.route_timing import RouteClock
from batcher.timings import PHASES, ROUTER_PHASES
from batcher.tokenizer import load_tokenizer
from tests.test_gateway_inprocess import ALICE, TENANTS, app_factory, auth, completion


def test_only_chunks_with_timings_are_rewritten() -> None:
    now = [10.0]
    clock = RouteClock(clock=lambda: now[0])
    now[0] = 10.25
    plain = b'data: {"choices":[{"text":"timings"}]}\n\n'
    assert clock.stream(plain) == plain
    usage = {"choices": [], "timings": {p + "_ms": 10.0 for p in PHASES} | {"total_ms": 60.0}}
    out = clock.stream(plain + b"data: " + orjson.dumps(usage) + b"\n\n")
    assert out.startswith(plain)
    t = orjson.loads(out[len(plain) + 6:].split(b"\n\n")[0])["timings"]
    assert t["route_ms"] == pytest.approx(190.0) and t["total_ms"] == pytest.approx(250.0)
    assert clock.whole(b'{"broken', {}) == b'{"broken'


async def test_router_adds_route_and_forwards_the_replica_phases(aiohttp_client, tiny_fp32
                                                                 ) -> None:
    replica = await aiohttp_client(app_factory(tiny_fp32, load_tokenizer(), TENANTS)())
    ctx = RouterContext(RouterConfig())
    rep = ctx.registry.add_static(str(replica.make_url("")).rstrip("/"))
    state = await (await replica.get("/v1/state")).json()
    assert ctx.registry.observe(rep.replica_id, state, ctx.clock())
    rep.ready = True
    router = await aiohttp_client(create_router_app(ctx))
    sent = time.monotonic()
    r = await router.post("/v1/completions", json=completion(max_tokens=4), headers=auth(ALICE))
    client_ms = (time.monotonic() - sent) * 1000
    assert r.status == 200, await r.text()
    t = (await r.json())["timings"]
    assert list(t)[:7] == [p + "_ms" for p in ROUTER_PHASES]
    assert t["route_ms"] > 0
    assert abs(sum(t[p + "_ms"] for p in ROUTER_PHASES) - t["total_ms"]) < 0.01
    assert t["total_ms"] <= client_ms + 1.0
    header = [part.split(";")[0] for part in r.headers["Server-Timing"].split(", ")]
    assert header == [*ROUTER_PHASES, "total"]

    r = await router.post("/v1/completions", json=completion(
        max_tokens=3, stream=True, stream_options={"include_usage": True}), headers=auth(ALICE))
    chunks = [json.loads(line[6:]) for line in (await r.text()).splitlines()
              if line.startswith("data: {")]
    st = chunks[-1]["timings"]
    assert st["route_ms"] >= 0 and st["completion_tokens"] == 3
    assert abs(sum(st[p + "_ms"] for p in ROUTER_PHASES) - st["total_ms"]) < 0.01
