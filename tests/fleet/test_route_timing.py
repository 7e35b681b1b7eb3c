"""The router's `route` phase in front of the replica's phases: a replica and a router
in-process (`aiohttp_client`), whole answers and a stream's usage chunk."""

from __future__ import annotations

import json
import time

import orjson
import pytest

from batcher.fleet.router.context import RouterConfig, RouterContext
from batcher.fleet.router.proxy import create_router_app
from batcher.fleet.router.route_timing import RouteClock
from batcher.telemetry.timings import PHASES, ROUTER_PHASES
from batcher.tokenizer.tokenizer import load_tokenizer
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


def test_whole_answers_keep_every_other_byte_and_read_nested_timings_as_data() -> None:
    now = [10.0]
    clock = RouteClock(clock=lambda: now[0])
    now[0] = 10.1
    timings = {p + "_ms": 10.0 for p in PHASES} | {"total_ms": 60.0}
    # Last key (as a replica writes it): the rest of the body is passed on byte for byte.
    head = b'{"id":"x","choices":[{"text":"a \\",\\"timings\\":{ b"}],"n":1.50'
    body = head + b',"timings":' + orjson.dumps(timings) + b"}"
    headers: dict[str, str] = {}
    out = clock.whole(body, headers)
    assert out.startswith(head) and "Server-Timing" in headers
    obj = orjson.loads(out)
    assert obj["choices"][0]["text"] == 'a ","timings":{ b'  # the marker, escaped
    assert obj["timings"]["route_ms"] == pytest.approx(40.0)
    assert obj["timings"]["total_ms"] == pytest.approx(100.0)
    # Not last, or nested: the whole body is read, and only the top level's timings change.
    for doc in ({"timings": timings, "id": "y"},
                {"id": "z", "timings": timings, "extra": {"timings": {"total_ms": 1.0}}}):
        obj = orjson.loads(clock.whole(orjson.dumps(doc), {}))
        assert obj["timings"]["route_ms"] == pytest.approx(40.0)
        assert obj.get("extra", {"timings": {"total_ms": 1.0}}) == {"timings": {"total_ms": 1.0}}


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


async def test_diagnose_through_a_router_names_route(aiohttp_client, tiny_fp32) -> None:
    """A router whose own share dominates (a replica behind a slow link, here a delay in
    front of it): the router's phase histograms make `route` the bottleneck."""
    import asyncio

    from aiohttp import web

    from batcher.app.diagnose import diagnose_url

    replica = await aiohttp_client(app_factory(tiny_fp32, load_tokenizer(), TENANTS)())

    @web.middleware
    async def slow_link(request, handler):
        await asyncio.sleep(0.3)
        return await handler(request)

    async def forward(request: web.Request) -> web.StreamResponse:
        up = await replica.post(request.path, data=await request.read(),
                                headers={k: v for k, v in request.headers.items()
                                         if k.lower() in ("authorization", "content-type")})
        return web.Response(status=up.status, body=await up.read(), headers={
            k: v for k, v in up.headers.items() if k.startswith("X-") or k == "Server-Timing"},
            content_type="application/json")

    link = web.Application(middlewares=[slow_link])
    link.router.add_post("/v1/completions", forward)

    async def forward_get(request: web.Request) -> web.StreamResponse:
        up = await replica.get(request.path)
        return web.Response(status=up.status, body=await up.read(),
                            content_type="application/json")

    for path in ("/health", "/ready", "/v1/state"):  # the router's health checks pass
        link.router.add_get(path, forward_get)
    far = await aiohttp_client(link)
    ctx = RouterContext(RouterConfig())
    rep = ctx.registry.add_static(str(far.make_url("")).rstrip("/"))
    assert ctx.registry.observe(rep.replica_id, await (await replica.get("/v1/state")).json(),
                                ctx.clock())
    rep.ready = True
    router = await aiohttp_client(create_router_app(ctx))
    for _ in range(2):
        r = await router.post("/v1/completions", json=completion(max_tokens=2),
                              headers=auth(ALICE))
        assert r.status == 200
    d = await diagnose_url(str(router.make_url("")).rstrip("/"), 0, {})
    assert d.requests == 2 and d.bottleneck == "route", d.lines()
    assert d.phases_ms["route"] >= 300 and "router" in d.action
