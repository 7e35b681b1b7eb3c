"""A replica's state is tenant-neutral: `X-Replica-State` goes only to its fleet (the router,
which sends the fleet key in `X-Fleet-Key` beside the tenant's own key), never on a refused
credential, and the public `/v1/state` leaves out the server-wide prefix-cache hits unless the
caller holds the admin or fleet key. The router sends the fleet key and still reads the
piggybacked state. One fake replica (a tenant, the fleet key) as a process on 127.0.0.1; the
router part in-process against a stub replica."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web

from batcher.engine.snapshot import CONTRACT_KEYS
from batcher.fleet.router.context import RouterConfig, RouterContext
from batcher.fleet.router.proxy import create_router_app
from tests.fleet.procs import (
    ADMIN_KEY,
    FLEET_KEY,
    STUB_STATE,
    Proc,
    replica,
    running,
    start_stub_replica,
    wait_http,
)
from tests.server_process import write_tenants

pytestmark = pytest.mark.timeout(60)

ALICE_KEY = "alice-state-privacy-key"
ALICE = {"Authorization": f"Bearer {ALICE_KEY}"}
FROM_FLEET = {"X-Fleet-Key": FLEET_KEY}
BODY = {"model": "fake", "prompt": "the same prompt, twice over", "max_tokens": 2}


@pytest.fixture(scope="module")
def rep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    root: Path = tmp_path_factory.mktemp("state-privacy")
    tenants = write_tenants(root / "tenants.toml", {
        "alice": {"key": ALICE_KEY, "tokens_per_minute": 10_000_000, "max_concurrent": 16}})
    r = replica("r0", "--tenants", str(tenants), decode_ms=1.0)
    with running(r):
        wait_http(r.url + "/ready", procs=(r,))
        yield r


async def test_replica_state_goes_to_the_fleet_only(rep: Proc) -> None:
    async with aiohttp.ClientSession() as s:
        # A tenant's answers, whole and streamed: no state.
        for body in (BODY, {**BODY, "stream": True}):
            async with s.post(rep.url + "/v1/completions", json=body, headers=ALICE) as r:
                await r.read()
                assert r.status == 200 and "X-Replica-State" not in r.headers
        # Refused credentials, with or without a (wrong) fleet key: no state.
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Fleet-Key": "wrong"},
                        FROM_FLEET):
            async with s.post(rep.url + "/v1/completions", json=BODY, headers=headers) as r:
                assert r.status == 401 and "X-Replica-State" not in r.headers, headers
        # The router: the tenant's key and the fleet key. Whole and streamed answers and a
        # refusal of the tenant's request (a 400) all carry it, prefix-cache hits included.
        for body in (BODY, {**BODY, "stream": True}, {**BODY, "max_tokens": -1}):
            async with s.post(rep.url + "/v1/completions", json=body,
                              headers={**ALICE, **FROM_FLEET}) as r:
                await r.read()
                state = orjson.loads(r.headers["X-Replica-State"])
                assert "prefix_hit_tokens" in state and state["total_blocks"] > 0, body
        # /v1/state: the contract keys for anyone, the private figures for the fleet and admin.
        for headers, private in (({}, False), (ALICE, False), (FROM_FLEET, True),
                                 ({"Authorization": f"Bearer {FLEET_KEY}"}, True),
                                 ({"Authorization": f"Bearer {ADMIN_KEY}"}, True)):
            async with s.get(rep.url + "/v1/state", headers=headers) as r:
                state = await r.json()
            assert set(CONTRACT_KEYS) <= set(state)
            assert ("prefix_hit_tokens" in state) == private, headers


async def test_the_router_sends_the_fleet_key_and_reads_the_piggyback(aiohttp_client) -> None:
    seen: list[str | None] = []

    async def completions(request: web.Request) -> web.Response:
        seen.append(request.headers.get("X-Fleet-Key"))
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "choices": []},
                                 headers={"X-Replica-State": orjson.dumps(
                                     {**STUB_STATE, "waiting": 7}).decode()})

    runner, url = await start_stub_replica(completions)
    try:
        ctx = RouterContext(RouterConfig(fleet_key=FLEET_KEY))
        ctx.registry.add_static(url, "s")
        ctx.registry.observe("s", STUB_STATE, ctx.clock())
        client = await aiohttp_client(create_router_app(ctx))
        resp = await client.post("/v1/completions", json=BODY, headers=ALICE)
        assert resp.status == 200, await resp.text()
        assert seen == [FLEET_KEY]
        st = ctx.registry.get("s").state  # type: ignore[union-attr]
        assert st is not None and st.waiting == 7
        # The router's own answer carries no replica's state to the tenant.
        assert FLEET_KEY not in str(resp.headers)
        header = resp.headers.get("X-Replica-State")
        assert header is None or "prefix_hit_tokens" not in header
    finally:
        await runner.cleanup()
