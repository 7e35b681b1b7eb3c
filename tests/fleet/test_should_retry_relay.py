"""`x-should-retry` through the router: a replica's verdict on its own answer reaches the client,
and the router's own answers carry theirs (false for a bad request, true for no replica)."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from tests.fleet.procs import (
    free_port,
    router,
    running,
    start_stub_replica,
    wait_http,
    wait_routable,
)


async def _stub() -> tuple[web.AppRunner, str]:
    """A replica double that refuses every generation with a 400, as `batcher serve` does."""
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response(
            {"error": {"message": "max_tokens must be >= 1", "type": "invalid_request_error",
                       "param": "max_tokens", "code": "invalid_value"}},
            status=400, headers={"x-should-retry": "false"})

    return await start_stub_replica(refuse)


async def test_router_relays_and_sets_x_should_retry():
    stub, url = await _stub()
    rt = router(replicas=(url,))
    try:
        with running(rt):
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: wait_http(rt.url + "/health", procs=(rt,)))
            async with aiohttp.ClientSession() as s:
                await wait_routable(s, rt, 1)
                body = {"model": "fake", "prompt": "hi", "max_tokens": 4}
                async with s.post(f"{rt.url}/v1/completions", json=body) as resp:
                    assert resp.status == 400
                    assert resp.headers["x-should-retry"] == "false"
                async with s.post(f"{rt.url}/v1/completions", data=b"{nope") as resp:
                    assert resp.status == 400
                    assert resp.headers["x-should-retry"] == "false"
    finally:
        await stub.cleanup()
    lonely = router(replicas=(f"http://127.0.0.1:{free_port()}",))
    with running(lonely):
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: wait_http(lonely.url + "/health", procs=(lonely,)))
        async with aiohttp.ClientSession() as s:
            body = {"model": "fake", "prompt": "hi", "max_tokens": 4}
            async with s.post(f"{lonely.url}/v1/completions", json=body) as resp:
                assert resp.status == 503
                assert resp.headers["x-should-retry"] == "true"
