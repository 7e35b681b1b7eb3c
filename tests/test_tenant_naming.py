"""Router and replica log a request under one tenant name: the replica names the tenant its key
resolved to on its answers to the fleet, and the router's access line uses that name (the key's
digest only where no replica named one). In process: a fake-model replica behind a router."""

from __future__ import annotations

import asyncio
import logging

from batcher.fleet.router.context import RouterConfig, RouterContext
from batcher.fleet.router.proxy import create_router_app
from batcher.http.keys import TENANT_HEADER
from tests.test_access_outcomes import ALICE, body, fake_app, key


async def both_lines(caplog, rid: str) -> list[dict]:
    """The replica's and the router's access lines of `rid` (the router writes its own just
    after the answer)."""
    for _ in range(250):
        lines = [rec.access for rec in caplog.records
                 if getattr(rec, "access", {}).get("request_id") == rid]
        if len(lines) == 2:
            return lines
        await asyncio.sleep(0.02)
    raise AssertionError(f"two access lines for {rid}: {lines}")


async def test_router_and_replica_name_the_tenant_alike(aiohttp_client, caplog) -> None:
    caplog.set_level(logging.INFO, logger="batcher.access")
    replica = await aiohttp_client(fake_app())
    ctx = RouterContext(RouterConfig())
    rep = ctx.registry.add_static(str(replica.make_url("")).rstrip("/"))
    assert ctx.registry.observe(rep.replica_id, await (await replica.get("/v1/state")).json(),
                                ctx.clock())
    router = await aiohttp_client(create_router_app(ctx))
    for rid, stream in (("t-whole", False), ("t-stream", True)):
        r = await router.post("/v1/completions", json=body(3, stream=stream),
                              headers=key(ALICE) | {"X-Request-Id": rid})
        assert r.status == 200 and TENANT_HEADER not in r.headers  # for the fleet only
        await r.read()
        lines = await both_lines(caplog, rid)
        assert {line["tenant"] for line in lines} == {"alice"}, lines
        assert {line["outcome"] for line in lines} == {"done"}, lines
    # A key no replica accepts: the replica refuses it (tenant "-"), the router keeps the digest.
    r = await router.post("/v1/completions", json=body(3),
                          headers=key("wrong") | {"X-Request-Id": "t-bad"})
    assert r.status == 401
    lines = await both_lines(caplog, "t-bad")
    assert sorted(line["outcome"] for line in lines) == ["refused", "refused"], lines
    assert "alice" not in {line["tenant"] for line in lines}


async def test_the_routers_own_refusals_have_a_line(aiohttp_client, caplog) -> None:
    caplog.set_level(logging.INFO, logger="batcher.access")
    router = await aiohttp_client(create_router_app(RouterContext(RouterConfig())))
    for rid, method, path, status, code in (
            ("r-404", "GET", "/v1/nowhere", 404, "not_found"),
            ("r-400", "POST", "/v1/completions", 400, "invalid_json")):
        r = await router.request(method, path, data=b"{",
                                 headers=key(ALICE) | {"X-Request-Id": rid})
        assert r.status == status
        (line,) = [rec.access for rec in caplog.records
                   if getattr(rec, "access", {}).get("request_id") == rid]
        assert (line["status"], line["error_code"], line["outcome"]) == (status, code,
                                                                        "refused"), line
        assert line["route"] == path
