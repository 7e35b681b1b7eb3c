"""One caller whose requests keep failing cannot spend every other caller's failover, and a 500
that is the request's own fault is not retried at all.

Pass figures: with both replicas failing every first attempt (500) and serving the retry, a
caller who sent 12 such requests has its retries cut by its own budget (503
`retry_budget_exhausted` after its floor of 3), while another caller's next 3 requests are all
served (200 after one retry each); a 500 marked `x-should-retry: false` reaches the client after
one attempt. Answers within 5 s each.

A real router on 127.0.0.1 in front of two in-process replica doubles that count attempts,
started and stopped by the test.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests.fleet.procs import (
    free_port,
    router,
    running,
    start_stub_replica,
    wait_http,
    wait_routable,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ALICE = {"Authorization": "Bearer alice-retry-budget"}
BOB = {"Authorization": "Bearer bob-retry-budget"}


class Flaky:
    """A replica that answers 500 to every first attempt and 200 to a retry; a body asking for
    `own_fault` gets a 500 marked as the request's own fault, whatever the attempt."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.hits: list[tuple[str, str]] = []
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            self.hits.append((request.headers["X-Request-Id"], request.headers["X-Attempt"]))
            if body.get("own_fault"):
                return web.json_response(
                    {"error": {"message": "internal error", "type": "api_error", "param": None,
                               "code": "internal_error"}},
                    status=500, headers={"x-should-retry": "false"})
            if request.headers["X-Attempt"] == "1":
                return web.json_response(
                    {"error": {"message": "boom", "type": "api_error", "param": None,
                               "code": "internal_error"}}, status=500)
            return web.json_response({"choices": [{"index": 0, "text": "ok"}]})

        self.runner, _ = await start_stub_replica(generate, self.port)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def _post(s: aiohttp.ClientSession, url: str, headers: dict[str, str], rid: str,
                **extra: object) -> tuple[int, dict]:
    body = orjson.dumps({"prompt": "hi", "max_tokens": 4, **extra})
    start = time.monotonic()
    async with s.post(url + "/v1/completions", data=body,
                      headers={**headers, "X-Request-Id": rid}) as resp:
        out = resp.status, orjson.loads(await resp.read())
    assert time.monotonic() - start < 5.0
    return out


async def test_a_failing_caller_does_not_spend_everyones_retries() -> None:
    stubs = [Flaky(), Flaky()]
    for st in stubs:
        await st.start()
    rt = router("--log-level", "info", "--retry-floor", "3",
                replicas=tuple(st.url for st in stubs))
    try:
        with running(rt):
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: wait_http(rt.url + "/health", procs=(rt,)))
            async with aiohttp.ClientSession() as s:
                await wait_routable(s, rt, 2)
                alice = [await _post(s, rt.url, ALICE, f"alice-{i}") for i in range(12)]
                codes = [b.get("error", {}).get("code") for status, b in alice if status != 200]
                assert sum(1 for status, _ in alice if status == 200) == 3, alice
                assert codes and set(codes) == {"retry_budget_exhausted"}, alice
                bob = [await _post(s, rt.url, BOB, f"bob-{i}") for i in range(3)]
                assert all(status == 200 for status, _ in bob), bob

                before = sum(len(st.hits) for st in stubs)
                status, body = await _post(s, rt.url, BOB, "bob-own-fault", own_fault=True)
                assert status == 500 and body["error"]["code"] == "internal_error", body
                assert sum(len(st.hits) for st in stubs) - before == 1, "retried a client fault"
    finally:
        for st in stubs:
            await st.stop()
