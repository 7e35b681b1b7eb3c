"""Tenants, budgets, cancel ownership, the admin listener and the bounded queue, against a real
`batcher serve` process on 127.0.0.1."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest

from tests.server_process import (
    DONE,
    Server,
    assert_error_shape,
    raw_http,
    server_fixture,
    sse_events,
    wait_idle,
    wait_state,
    write_tenants,
)

MODEL = "tiny"
C = "/v1/completions"
LONG = 3000  # seconds of decoding for the tiny model: still running while the test acts
ADMIN_KEY = "admin-secret-key"
ALICE, BOB, SMALL = "alice-key-0123", "bob-key-4567", "small-key-89ab"
# 20 tokens/s refill and a 60-token bucket: one 40-token request fits, a second must wait ~2 s.
SMALL_TPM, SMALL_BURST = 1200, 60


def tenants_flags(tmp: pytest.TempPathFactory) -> list[str]:
    path = write_tenants(tmp.mktemp("tenants") / "tenants.toml", {
        "alice": {"key": ALICE, "tokens_per_minute": 10_000_000, "max_concurrent": 16},
        "bob": {"key": BOB, "tokens_per_minute": 10_000_000, "max_concurrent": 16},
        "small": {"key": SMALL, "tokens_per_minute": SMALL_TPM, "burst": SMALL_BURST,
                  "max_concurrent": 4, "priorities": ["interactive"]},
    })
    return ["--tenants", str(path)]


server = server_fixture(setup=tenants_flags, admin_key=ADMIN_KEY)
# One sequence at a time and one waiting slot: the third concurrent request finds the queue full.
# The count bound alone: with the TTFT check on, a calibrated server refuses the second request
# for its wait (queue_slo) before the queue can fill.
small_queue = server_fixture("--max-num-seqs", "1", "--max-waiting", "1", "--slo-ttft-ms", "0")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **kw}


@pytest.fixture
async def session() -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        yield s


async def test_keys_are_required_and_checked(server: Server,
                                             session: aiohttp.ClientSession) -> None:
    for headers in ({}, auth("wrong-key"), {"Authorization": f"Basic {ALICE}"},
                    {"Authorization": "Bearer "}, auth(ADMIN_KEY)):
        async with session.post(server.url + C, json=completion(), headers=headers) as resp:
            assert resp.status == 401, headers
            assert resp.headers.get("X-Request-Id")
            err = assert_error_shape(await resp.json())
        assert err["type"] == "authentication_error"
        assert ALICE not in err["message"]  # keys never echo back
    async with session.post(server.url + C, json=completion(), headers=auth(ALICE)) as resp:
        assert resp.status == 200
    async with session.post(server.url + C, json=completion(),
                            headers={"x-api-key": BOB}) as resp:
        assert resp.status == 200
    # A key that is not even UTF-8 is just a wrong key.
    status, body = await raw_http(server.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                  b"Authorization: Bearer \xff\xfe\x80\r\n"
                                  b"Content-Length: 0\r\nConnection: close\r\n\r\n")
    assert status == 401
    assert_error_shape(orjson.loads(body))
    # Liveness, readiness, capacity and metrics stay open: routers and scrapers hold no keys.
    for path in ("/health", "/ready", "/v1/state", "/metrics"):
        async with session.get(server.url + path) as resp:
            assert resp.status == 200, path


async def test_small_budget_gets_429_and_retry_after_is_enough(
        server: Server, session: aiohttp.ClientSession) -> None:
    body = completion(max_tokens=40, ignore_eos=True)
    async with session.post(server.url + C, json=body, headers=auth(SMALL)) as resp:
        assert resp.status == 200, await resp.text()
    async with session.post(server.url + C, json=body, headers=auth(SMALL)) as resp:
        assert resp.status == 429
        err = assert_error_shape(await resp.json())
        retry_after = int(resp.headers["Retry-After"])
    assert err["type"] == "rate_limit_error" and err["code"] == "tenant_tokens"
    assert 1 <= retry_after <= 5
    # Other tenants are not charged for the small tenant's spending.
    async with session.post(server.url + C, json=body, headers=auth(ALICE)) as resp:
        assert resp.status == 200
    await asyncio.sleep(retry_after)
    async with session.post(server.url + C, json=body, headers=auth(SMALL)) as resp:
        assert resp.status == 200, await resp.text()
    # A request bigger than the whole bucket could never run: 400, not a 429 to retry forever.
    async with session.post(server.url + C, json=completion(max_tokens=SMALL_BURST + 1),
                            headers=auth(SMALL)) as resp:
        assert resp.status == 400
        assert_error_shape(await resp.json())
    # A priority the tenant may not use.
    async with session.post(server.url + C, json=completion(priority="batch"),
                            headers=auth(SMALL)) as resp:
        assert resp.status == 400
        assert assert_error_shape(await resp.json())["param"] == "priority"


async def test_only_the_owner_cancels_and_the_stream_says_so(
        server: Server, session: aiohttp.ClientSession) -> None:
    rid = "job-1"
    body = completion(max_tokens=LONG, ignore_eos=True, stream=True)
    resp = await session.post(server.url + C, json=body,
                              headers={**auth(ALICE), "X-Request-Id": rid})
    try:
        assert resp.status == 200 and resp.headers["X-Request-Id"] == rid
        events = sse_events(resp)
        first = await anext(events)
        assert first["choices"][0]["finish_reason"] is None
        # Request IDs are scoped per tenant: Bob may use the same one, and sees nothing of Alice's.
        async with session.post(server.url + C, json=completion(),
                                headers={**auth(BOB), "X-Request-Id": rid}) as other:
            assert other.status == 200 and other.headers["X-Request-Id"] == rid
        async with session.delete(f"{server.url}/v1/requests/{rid}", headers=auth(BOB)) as d:
            assert d.status == 404
            assert assert_error_shape(await d.json())["type"] == "not_found_error"
            assert d.headers.get("X-Request-Id")
        async with session.delete(f"{server.url}/v1/requests/{rid}") as d:
            assert d.status == 401
        st = await wait_state(session, server.url, lambda s: s["running"] == 1, within=2)
        assert st["running"] == 1, "Bob's attempts left Alice's request running"
        async with session.delete(f"{server.url}/v1/requests/{rid}", headers=auth(ALICE)) as d:
            assert d.status == 200
            assert (await d.json())["cancelled"] is True
        rest = [ev async for ev in events]
    finally:
        resp.close()
    # The same rule as a whole answer: the partial output, ended by finish_reason "abort" (an
    # error event would make a router retry a request its owner cancelled).
    assert rest[-1] == DONE
    assert not [ev for ev in rest[:-1] if "error" in ev], rest[-3:]
    finishes = [ev["choices"][0]["finish_reason"] for ev in rest[:-1] if ev.get("choices")]
    assert finishes[-1] == "abort" and finishes.count("abort") == 1, rest[-3:]
    assert not {"length", "stop"} & set(finishes)
    await wait_idle(session, server.url)


async def test_cancelled_whole_answer_ends_with_finish_reason_abort(
        server: Server, session: aiohttp.ClientSession) -> None:
    rid = "job-2"

    async def call() -> tuple[int, Any]:
        async with session.post(server.url + C, json=completion(max_tokens=LONG, ignore_eos=True),
                                headers={**auth(ALICE), "X-Request-Id": rid}) as resp:
            return resp.status, await resp.json()

    task = asyncio.create_task(call())
    try:
        await wait_state(session, server.url, lambda s: s["running"] == 1, within=5)
        async with session.delete(f"{server.url}/v1/requests/{rid}", headers=auth(ALICE)) as d:
            assert d.status == 200
        status, body = await asyncio.wait_for(task, 5)
    finally:
        task.cancel()
    # Not a 5xx: clients would retry a request its owner cancelled. The partial output comes
    # back, explicitly marked.
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "abort"
    assert body["usage"]["completion_tokens"] < LONG
    await wait_idle(session, server.url)


async def test_admin_routes_need_their_own_listener_and_key(
        server: Server, session: aiohttp.ClientSession) -> None:
    assert server.admin_url is not None
    # Not on the public listener, even for a valid tenant.
    for path in ("/admin/drain", "/admin/undrain"):
        async with session.post(server.url + path, headers=auth(ALICE)) as resp:
            assert resp.status == 404, path
            assert_error_shape(await resp.json())
    # Bad or missing admin keys; a tenant key is not an admin key.
    for headers in ({}, auth("nope"), auth(ALICE), {"Authorization": ADMIN_KEY}):
        async with session.post(server.admin_url + "/admin/drain", headers=headers) as resp:
            assert resp.status == 401, headers
            assert_error_shape(await resp.json())
    status, body = await raw_http(server.admin_url, b"POST /admin/drain HTTP/1.1\r\n"
                                  b"Host: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                                  b"Content-Length: 0\r\nConnection: close\r\n\r\n")
    assert status == 401
    assert_error_shape(orjson.loads(body))
    async with session.get(server.url + "/ready") as resp:
        assert resp.status == 200, "a refused drain must change nothing"
    async with session.post(server.admin_url + "/admin/nope", headers=auth(ADMIN_KEY)) as resp:
        assert resp.status == 404
        assert_error_shape(await resp.json())
        assert resp.headers.get("X-Request-Id")
    async with session.get(server.admin_url + "/admin/status", headers=auth(ADMIN_KEY)) as resp:
        assert resp.status == 200 and resp.headers.get("X-Request-Id")
        assert (await resp.json())["draining"] is False
    try:
        async with session.post(server.admin_url + "/admin/drain",
                                headers=auth(ADMIN_KEY)) as resp:
            assert resp.status == 200
            assert (await resp.json())["draining"] is True
        async with session.get(server.url + "/ready") as resp:
            assert resp.status == 503
        async with session.post(server.url + C, json=completion(), headers=auth(ALICE)) as resp:
            assert resp.status == 503
            assert int(resp.headers["Retry-After"]) >= 1
            assert assert_error_shape(await resp.json())["code"] == "draining"
        async with session.get(server.url + "/v1/state") as resp:
            assert (await resp.json())["draining"] is True
    finally:
        async with session.post(server.admin_url + "/admin/undrain",
                                headers=auth(ADMIN_KEY)) as resp:
            assert resp.status == 200
    async with session.get(server.url + "/ready") as resp:
        assert resp.status == 200
    async with session.post(server.url + C, json=completion(), headers=auth(ALICE)) as resp:
        assert resp.status == 200


async def test_full_queue_gets_503_with_retry_after(small_queue: Server,
                                                    session: aiohttp.ClientSession) -> None:
    url = small_queue.url
    body = completion(max_tokens=LONG, ignore_eos=True, stream=True)
    running = await session.post(url + C, json=body)
    # The queued request's headers only come with its first token: post it in the background.
    queued = asyncio.create_task(session.post(url + C, json=body))
    try:
        assert running.status == 200
        await running.content.readline()
        await wait_state(session, url, lambda s: s["running"] == 1 and s["waiting"] == 1)
        async with session.post(url + C, json=completion()) as resp:
            assert resp.status == 503, await resp.text()
            assert int(resp.headers["Retry-After"]) >= 1
            err = assert_error_shape(await resp.json())
            assert resp.headers.get("X-Request-Id")
        assert err["code"] == "queue_full"
    finally:
        queued.cancel()
        running.close()
    await wait_idle(session, url)
    async with session.post(url + C, json=completion()) as resp:
        assert resp.status == 200
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    assert 'batcher_requests_rejected_total{reason="queue_full"} 1.0' in text
