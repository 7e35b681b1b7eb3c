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

from batcher.fleet.router import batch_ids, responses_proxy
from batcher.fleet.router.context import RouterConfig, RouterContext
from batcher.fleet.router.proxy import ROUTER, create_router_app
from tests.fleet.procs import STUB_STATE, start_stub_replica
from tests.test_metrics_contract import labelled

KEY = "the-key"
ASKED: list[str] = []  # the fixture's replicas' lookups, "replica:id"


async def holder(name: str, held: set[str], seen: list[str],
                 hang: asyncio.Event | None = None, asked: list[str] | None = None
                 ) -> tuple[web.AppRunner, str]:
    """A replica double holding the responses in `held` for KEY; POSTs are recorded in `seen`
    (with their previous_response_id, when one was sent), lookups in `asked`. With `hang`, its
    lookups answer only once the event is set."""

    def owns(request: web.Request) -> bool:
        return (request.match_info["id"] in held
                and request.headers.get("Authorization") == f"Bearer {KEY}")

    async def get(request: web.Request) -> web.Response:
        if asked is not None:
            asked.append(f"{name}:{request.match_info['id']}")
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
        prev = (await request.json()).get("previous_response_id")
        seen.append(name if prev is None else f"{name}<-{prev}")
        held.add(f"resp_{name}new")
        return web.json_response({"id": f"resp_{name}new", "object": "response", "on": name,
                                  "previous_response_id": prev})

    return await start_stub_replica(routes=[("GET", "/v1/responses/{id}", get), ("DELETE", "/v1/responses/{id}", delete),
                   ("POST", "/v1/responses", create)])


@pytest.fixture
async def fleet(aiohttp_client) -> Any:
    seen: list[str] = []
    held = {"r0": set(), "r1": {"resp_a"}}
    runners = []
    ctx = RouterContext(RouterConfig())
    for name in ("r0", "r1"):
        runner, url = await holder(name, held[name], seen, asked=ASKED)
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
    assert seen == ["r1<-resp_a"] * 6
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
    # Counted under the route's pattern: an id in a path never becomes a label.
    text = await (await client.get("/metrics")).text()
    assert labelled(text, "batcher_router_requests_by_route_total") == {
        (("route", "/v1/responses/{id}"), ("status", "200")): 2.0,
        (("route", "/v1/responses/{id}"), ("status", "404")): 2.0}
    assert "resp_a" not in text


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


async def test_ids_name_their_replica_and_go_there_alone(fleet) -> None:
    client, seen, held = fleet
    ASKED.clear()
    resp = await client.post("/v1/responses", headers=AUTH, json={"input": "Hi"})
    made = await resp.json()
    owner = made["on"]
    assert made["id"] == batch_ids.encode(f"resp_{owner}new", owner)
    resp = await client.get(f"/v1/responses/{made['id']}", headers=AUTH)
    assert resp.status == 200 and (await resp.json())["id"] == made["id"]
    assert ASKED == [f"{owner}:resp_{owner}new"]  # its owner alone
    other = await client.get(f"/v1/responses/{made['id']}",
                             headers={"Authorization": "Bearer other"})
    assert other.status == 404  # another tenant's id
    seen.clear()
    ASKED.clear()
    for _ in range(4):  # a continuation goes to the owner, with no lookup at all
        resp = await client.post("/v1/responses", headers=AUTH, json={
            "input": "Again", "previous_response_id": made["id"]})
        assert (await resp.json())["previous_response_id"] == made["id"]
    assert seen == [f"{owner}<-resp_{owner}new"] * 4 and ASKED == []
    forged = batch_ids.encode("resp_x", "nowhere")
    assert (await client.get(f"/v1/responses/{forged}", headers=AUTH)).status == 404
    resp = await client.delete(f"/v1/responses/{made['id']}", headers=AUTH)
    assert resp.status == 200 and f"resp_{owner}new" not in held[owner]


async def test_untagged_lookups_are_bounded_per_caller(aiohttp_client) -> None:
    release = asyncio.Event()
    ctx = RouterContext(RouterConfig())
    runner, url = await holder("r0", set(), [], release)
    ctx.registry.add_static(url, "r0")
    assert ctx.registry.observe("r0", STUB_STATE, ctx.clock(), poll=True)
    client = await aiohttp_client(create_router_app(ctx))
    try:
        hung = [asyncio.ensure_future(client.get(f"/v1/responses/resp_{i}", headers=AUTH))
                for i in range(responses_proxy.MAX_FANOUTS_PER_SCOPE)]
        while sum(ctx.lookups.values()) < responses_proxy.MAX_FANOUTS_PER_SCOPE:
            await asyncio.sleep(0.01)
        resp = await client.get("/v1/responses/resp_more", headers=AUTH)
        assert resp.status == 429 and resp.headers["Retry-After"] == "1"
        # Another caller has its own bound: its lookup runs.
        hung.append(asyncio.ensure_future(client.post("/v1/responses", json={
            "input": "Hi", "previous_response_id": "resp_more"},
            headers={"Authorization": "Bearer other"})))
        while sum(ctx.lookups.values()) <= responses_proxy.MAX_FANOUTS_PER_SCOPE:
            await asyncio.sleep(0.01)
        release.set()
        assert [(await r).status for r in hung] == [404] * len(hung)
        assert ctx.lookups == {}
    finally:
        release.set()
        await runner.cleanup()


async def test_a_holder_out_of_reach_is_a_503_not_a_404(fleet) -> None:
    client, _, _ = fleet
    ctx = client.app[ROUTER]
    ctx.registry.get("r1").evicted = True  # it holds resp_a
    for method, path in (("GET", "/v1/responses/resp_a"), ("DELETE", "/v1/responses/resp_a")):
        resp = await client.request(method, path, headers=AUTH)
        assert resp.status == 503 and resp.headers["Retry-After"] == "1", method
    resp = await client.post("/v1/responses", headers=AUTH, json={
        "input": "Hi", "previous_response_id": "resp_a"})
    assert resp.status == 503 and "Retry-After" in resp.headers
    tagged = batch_ids.encode("resp_a", "r1")  # a tagged id whose owner is out of reach
    resp = await client.get(f"/v1/responses/{tagged}", headers=AUTH)
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    resp = await client.post("/v1/responses", headers=AUTH, json={
        "input": "Hi", "previous_response_id": tagged})
    assert resp.status == 503 and "Retry-After" in resp.headers
    ctx.registry.get("r1").evicted = False
    assert (await client.get("/v1/responses/resp_a", headers=AUTH)).status == 200
