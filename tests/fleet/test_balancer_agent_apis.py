"""/v1/messages and /v1/responses through the global balancer, in-process, over a cell double that
records what reaches it: the body and the caller's key arrive as sent, answers and streams come
back as the cell gave them (a stored response's id tagged with its cell, as any router tags it),
and the balancer counts each request under its route."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from batcher.fleet.balancer.app import BalancerContext, create_balancer_app
from batcher.fleet.balancer.policy import BalancerConfig
from batcher.fleet.router import batch_ids
from batcher.fleet.router.context import RouterConfig
from tests.fleet.procs import STUB_STATE, start_stub_replica
from tests.test_metrics_contract import labelled

MESSAGE = {"id": "msg_0a1b", "type": "message", "role": "assistant", "model": "fake",
           "content": [{"type": "text", "text": "Paris."}], "stop_reason": "end_turn",
           "stop_sequence": None, "usage": {"input_tokens": 9, "output_tokens": 2}}
RESPONSE = {"id": "resp_0a1b2c3d", "object": "response", "status": "completed", "model": "fake",
            "output": [{"type": "message", "id": "msg_1", "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": "Paris.",
                                     "annotations": []}]}],
            "previous_response_id": None,
            "usage": {"input_tokens": 9, "output_tokens": 2, "total_tokens": 11}}
STREAM = b"".join(
    b"event: %s\ndata: %s\n\n" % (name.encode(), orjson.dumps(dict(data, type=name)))
    for name, data in (
        ("message_start", {"message": dict(MESSAGE, content=[], stop_reason=None)}),
        ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Paris."}}),
        ("content_block_stop", {"index": 0}),
        ("message_delta", {"delta": {"stop_reason": "end_turn"},
                           "usage": {"output_tokens": 2}}),
        ("message_stop", {})))


async def cell(seen: list[tuple[str, dict[str, str], bytes]]) -> tuple[web.AppRunner, str]:
    """A cell double: healthy and idle; /v1/messages and /v1/responses answer the canned
    bodies above (a stream when asked for one) and record (path, headers, body)."""

    async def generate(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        seen.append((request.path, dict(request.headers), raw))
        if request.path == "/v1/responses":
            return web.json_response(RESPONSE)
        if not orjson.loads(raw).get("stream"):
            return web.json_response(MESSAGE)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in STREAM.split(b"\n\n")[:-1]:
            await resp.write(event + b"\n\n")
        await resp.write_eof()
        return resp

    return await start_stub_replica(routes=[("POST", "/v1/messages", generate), ("POST", "/v1/responses", generate)])


async def test_agent_apis_pass_through_the_balancer(aiohttp_client) -> None:
    seen: list[tuple[str, dict[str, str], bytes]] = []
    runner, url = await cell(seen)
    try:
        ctx = BalancerContext(RouterConfig(), BalancerConfig())
        ctx.registry.add_static(url, "c0")
        assert ctx.registry.observe("c0", STUB_STATE, ctx.clock(), poll=True)
        client = await aiohttp_client(create_balancer_app(ctx))
        anthropic = {"x-api-key": "k-1", "anthropic-version": "2023-06-01",
                     "Content-Type": "application/json"}
        message = orjson.dumps({"model": "fake", "max_tokens": 8, "system": "Be brief.",
                                "messages": [{"role": "user", "content": "Capital of France?"}]})
        resp = await client.post("/v1/messages", data=message, headers=anthropic)
        assert resp.status == 200 and orjson.loads(await resp.read()) == MESSAGE
        streamed = orjson.dumps(dict(orjson.loads(message), stream=True))
        resp = await client.post("/v1/messages", data=streamed, headers=anthropic)
        assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
        assert await resp.read() == STREAM
        question: dict[str, Any] = {"model": "fake", "input": "Capital of France?",
                                    "instructions": "Answer in one word.",
                                    "max_output_tokens": 8}
        resp = await client.post("/v1/responses", json=question,
                                 headers={"Authorization": "Bearer k-2"})
        assert resp.status == 200
        got = orjson.loads(await resp.read())
        # The id names its cell, so a continuation finds it; everything else is the cell's.
        assert batch_ids.decode(got["id"]) == (RESPONSE["id"], "c0")
        assert dict(got, id=RESPONSE["id"]) == RESPONSE
        assert [path for path, _, _ in seen] == ["/v1/messages"] * 2 + ["/v1/responses"]
        (_, h1, b1), (_, h2, b2), (_, h3, b3) = seen
        assert b1 == message and b2 == streamed and orjson.loads(b3) == question
        assert h1["x-api-key"] == h2["x-api-key"] == "k-1"
        assert h3["Authorization"] == "Bearer k-2"
        text = await (await client.get("/metrics")).text()
        assert labelled(text, "batcher_router_requests_by_route_total") == {
            (("route", "/v1/messages"), ("status", "200")): 2.0,
            (("route", "/v1/responses"), ("status", "200")): 1.0}
    finally:
        await runner.cleanup()
