"""Stored responses behind the router, in-process over two replica doubles: a continuation goes
to the replica holding its `previous_response_id` whichever the policy would prefer, GET and
DELETE reach the holder, an id nobody holds (or another key's) is a 404, and errors on
/v1/messages from the router itself take Anthropic's shape."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from aiohttp import web

from batcher.fleet import responses_proxy
from batcher.fleet.context import RouterConfig, RouterContext
from batcher.fleet.proxy import create_router_app
from tests.fleet.procs import STUB_STATE, free_port

KEY = "the-key"


async def holder(name: str, held: set[str], seen: list[str],
                 hang: asyncio.Event | None = None) -> tuple[web.AppRunner, str]:
    """A replica double holding the responses in `held` for KEY; POSTs are recorded in `seen`.
    With `hang`, its lookups answer only once the event is set."""

    def owns(request: web.Request) -> bool:
        return (request.match_info["id"] in held
                and request.headers.get("Authorization") == f"Bearer {KEY}")

    async def get(request: web.Request) -> web.Response:
        if hang is not None:
            await hang.wait()
        if not owns(request):
            return web.json_response({"error": {"message": "no"}}, status=404)
        return web.json_response({"id": request.match_info["id"], "object": "response",
                                  "on": name})

    async def delete(request: web.Request) -> web.Response:
        if not owns(request):
            return web.json_response({"error": {"message": "no"}}, status=404)
        held.discard(request.match_info["id"])
        return web.json_response({"id": request.match_info["id"], "deleted": True})

    async def create(request: web.Request) -> web.Response:
        seen.append(name)
        return web.json_response({"id": "resp_new", "object": "response", "on": name})

    async def ok(request: web.Request) -> web.Response:
        return web.json_response(STUB_STATE if request.path == "/v1/state" else {"ok": True})

    app = web.Application()
    app.router.add_get("/v1/responses/{id}", get)
    app.router.add_delete("/v1/responses/{id}", delete)
    app.router.add_post("/v1/responses", create)
    for path in ("/health", "/ready", "/v1/state"):
        app.router.add_get(path, ok)
    app.router.add_post("/v1/probe", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def fleet(aiohttp_client) -> Any:
    seen: list[str] = []
    held = {"r0": set(), "r1": {"resp_a"}}
    runners = []
    ctx = RouterContext(RouterConfig())
    for name in ("r0", "r1"):
        runner, url = await holder(name, held[name], seen)
        runners.append(runner)
        ctx.registry.add_static(url, name)
        assert ctx.registry.observe(name, STUB_STATE, ctx.clock(), poll=True)
    client = await aiohttp_client(create_router_app(ctx))
    yield client, seen, held
    for runner in runners:
        await runner.cleanup()


AUTH = {"Authorization": f"Bearer {KEY}"}


async def test_a_continuation_goes_to_the_holder(fleet) -> None:
    client, seen, _ = fleet
    for _ in range(6):
        resp = await client.post("/v1/responses", headers=AUTH, json={
            "input": "Hi", "previous_response_id": "resp_a"})
        assert resp.status == 200, await resp.text()
    assert seen == ["r1"] * 6
    seen.clear()
    for _ in range(6):  # without one, either replica may serve
        assert (await client.post("/v1/responses", headers=AUTH, json={"input": "Hi"})
                ).status == 200
    assert len(seen) == 6
    resp = await client.post("/v1/responses", headers=AUTH, json={
        "input": "Hi", "previous_response_id": "resp_nowhere"})
    assert resp.status == 404
    assert (await resp.json())["error"]["param"] == "previous_response_id"


async def test_get_and_delete_reach_the_holder(fleet) -> None:
    client, _, held = fleet
    resp = await client.get("/v1/responses/resp_a", headers=AUTH)
    assert resp.status == 200 and (await resp.json())["on"] == "r1"
    other = await client.get("/v1/responses/resp_a", headers={"Authorization": "Bearer other"})
    assert other.status == 404  # every replica refuses another key's id
    resp = await client.delete("/v1/responses/resp_a", headers=AUTH)
    assert resp.status == 200 and held["r1"] == set()
    assert (await client.get("/v1/responses/resp_a", headers=AUTH)).status == 404


async def test_router_errors_on_messages_take_anthropics_shape(fleet) -> None:
    client, _, _ = fleet
    resp = await client.post("/v1/messages", headers=AUTH, data=b"[1")
    assert resp.status == 400
    body = orjson.loads(await resp.read())
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


async def test_a_hung_replica_does_not_delay_the_holders_answer(aiohttp_client,
                                                                monkeypatch) -> None:
    monkeypatch.setattr(responses_proxy, "LOOKUP_TIMEOUT_S", 120.0)
    release = asyncio.Event()
    ctx = RouterContext(RouterConfig())
    runners = []
    for name, held, hang in (("r0", set(), release), ("r1", {"resp_a"}, None)):
        runner, url = await holder(name, held, [], hang)
        runners.append(runner)
        ctx.registry.add_static(url, name)
        assert ctx.registry.observe(name, STUB_STATE, ctx.clock(), poll=True)
    client = await aiohttp_client(create_router_app(ctx))
    try:
        resp = await asyncio.wait_for(client.get("/v1/responses/resp_a", headers=AUTH), 20)
        assert resp.status == 200 and (await resp.json())["on"] == "r1"
    finally:
        release.set()
        for runner in runners:
            await runner.cleanup()
