"""The retry budget against replicas that all answer 503 (in-process stubs that count every
attempt), recovery, and the router's own answers when no replica can serve."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from tests.fleet.procs import (
    FLEET,
    free_port,
    router,
    running,
    start_stub_replica,
    wait_http,
    wait_routable,
)


class Stub:
    """A replica double: healthy, with capacity numbers, answering 503 capacity while
    `reject` is set; it records (request id, attempt) of every generation attempt."""

    def __init__(self, name: str):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.reject = False
        self.hits: list[tuple[str, str]] = []
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def generate(request: web.Request) -> web.Response:
            self.hits.append((request.headers["X-Request-Id"], request.headers["X-Attempt"]))
            if self.reject:
                return web.json_response({"error": {"message": "full", "code": "queue_full"}},
                                         status=503, headers={"Retry-After": "1",
                                                              "X-Reject-Reason": "capacity"})
            return web.json_response({"choices": [{"index": 0, "text": self.name}]})

        self.runner, _ = await start_stub_replica(generate, self.port)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def post(s: aiohttp.ClientSession, url: str, rid: str | None = None
               ) -> tuple[int, CIMultiDict[str], dict]:
    headers = {"X-Request-Id": rid} if rid else {}
    body = orjson.dumps({"model": "fake", "prompt": "hi", "max_tokens": 4})
    async with s.post(f"{url}/v1/completions", data=body, headers=headers) as resp:
        return resp.status, resp.headers.copy(), orjson.loads(await resp.read())


async def test_all_503_attempts_stay_within_budget_and_recovery_is_quick():
    stubs = [Stub("a"), Stub("b")]
    for st in stubs:
        await st.start()
    rt = router(replicas=tuple(st.url for st in stubs))
    try:
        with running(rt):
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: wait_http(rt.url + "/health", procs=(rt,)))
            async with aiohttp.ClientSession() as s:
                await wait_routable(s, rt, 2)
                for st in stubs:
                    st.reject = True
                gate = asyncio.Semaphore(20)

                async def one(i: int):
                    async with gate:
                        return await post(s, rt.url, rid=f"r-{i}")

                n = 200
                results = await asyncio.gather(*(one(i) for i in range(n)))
                assert all(status == 503 for status, _, _ in results)
                assert all("Retry-After" in headers for _, headers, _ in results)
                attempts = [h for st in stubs for h in st.hits]
                assert len(attempts) / n <= 1.1, len(attempts)
                assert any(b["error"]["code"] == "retry_budget_exhausted"
                           for _, _, b in results)
                # A retry keeps the request id, counts up X-Attempt, and never goes back.
                by_id: dict[str, list[tuple[str, str]]] = defaultdict(list)
                for st in stubs:
                    for rid, attempt in st.hits:
                        by_id[rid].append((st.name, attempt))
                retried = [v for v in by_id.values() if len(v) > 1]
                assert retried and all(sorted(a for _, a in v) == ["1", "2"]
                                       and v[0][0] != v[1][0] for v in retried)

                for st in stubs:
                    st.reject = False
                t0 = time.monotonic()
                while (await post(s, rt.url))[0] != 200:
                    assert time.monotonic() - t0 < 2.0, "no recovery within 2 s"
                    await asyncio.sleep(0.05)
                oks = await asyncio.gather(*(post(s, rt.url) for _ in range(20)))
                assert all(status == 200 for status, _, _ in oks)
    finally:
        for st in stubs:
            await st.stop()


async def test_router_answers_for_itself_without_replicas():
    rt = router(replicas=(f"http://127.0.0.1:{free_port()}",))
    with running(rt):
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: wait_http(rt.url + "/health", procs=(rt,)))
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{rt.url}/ready") as resp:
                assert resp.status == 503
            status, headers, body = await post(s, rt.url, rid="mine")
            assert status == 503 and headers["X-Request-Id"] == "mine"
            assert body["error"]["code"] == "no_replica" and headers["Retry-After"] == "1"
            async with s.post(f"{rt.url}/v1/completions", data=b"{nope") as resp:
                assert resp.status == 400 and "X-Request-Id" in resp.headers
            async with s.post(f"{rt.url}/internal/heartbeat", data=b"[]") as resp:
                assert resp.status == 404  # heartbeats are on the internal listener only
            async with s.post(f"{rt.internal_url}/internal/heartbeat", data=b"[]") as resp:
                assert resp.status == 401  # the fleet key comes first
            async with s.post(f"{rt.internal_url}/internal/heartbeat", data=b"[]",
                              headers=FLEET) as resp:
                assert resp.status == 400
            async with s.get(f"{rt.url}/v1/state") as resp:
                st = await resp.json()
                assert st["healthy"] is False and st["replicas"] == 1 and st["routable"] == 0
            async with s.get(f"{rt.url}/metrics") as resp:
                assert "batcher_router_client_requests_total" in await resp.text()
