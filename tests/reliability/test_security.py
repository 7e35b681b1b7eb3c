"""Security: keys, tenant isolation of request IDs, the admin listener, secrets in logs, body limits
and slow clients.

Pass figures: a wrong key is 401; another tenant's request ID is 404 on cancel and never
visible in any response; admin routes are absent from the public listener; the API keys and the
prompt text never appear in the server's log at the default level; a body over the limit is 413
before it is read whole; slow-loris clients (headers trickled byte by byte) are cut off by a timeout
without starving other clients.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.reliability.conftest import FAKE, percentile
from tests.reliability.slow_client import trickle_headers
from tests.server_process import (
    Server,
    assert_error_shape,
    serve,
    server_fixture,
    sse_events,
    wait_state,
    write_tenants,
)

TAG = uuid.uuid4().hex[:12]
ALICE_KEY = f"alice-secret-key-{TAG}"
BOB_KEY = f"bob-secret-key-{TAG}"
WRONG_KEY = f"wrong-key-{TAG}"
ADMIN_KEY = f"admin-key-{TAG}"
PROMPT = f"confidential prompt text {TAG}"
# Request IDs are logged (the access line correlates them), so this one carries no secret tag.
SECRET_ID = f"alice-request-{uuid.uuid4().hex[:12]}"
MAX_BODY = 65536
ALICE = {"Authorization": f"Bearer {ALICE_KEY}"}
BOB = {"Authorization": f"Bearer {BOB_KEY}"}
EMBEDDER = "all-minilm-l6-v2"


def _setup(tmp: pytest.TempPathFactory) -> list[str]:
    path = write_tenants(Path(tmp.mktemp("security")) / "tenants.toml", {
        "alice": {"key": ALICE_KEY, "tokens_per_minute": 1e7, "max_concurrent": 64},
        "bob": {"key": BOB_KEY, "tokens_per_minute": 1e7, "max_concurrent": 64}})
    return ["--tenants", str(path)]


# The default log level (info): nothing secret may reach it.
server = server_fixture("--embedding-model", "minilm", "--max-body-bytes", str(MAX_BODY),
                        setup=_setup, admin_key=ADMIN_KEY)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def completion(**kw: object) -> dict[str, object]:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, **kw}


async def test_wrong_key_is_401(server: Server, session: aiohttp.ClientSession) -> None:
    cases = [{"Authorization": f"Bearer {WRONG_KEY}"}, {"x-api-key": WRONG_KEY}, {},
             {"Authorization": f"Basic {WRONG_KEY}"}, {"Authorization": "Bearer "},
             {"Authorization": f"Bearer {ALICE_KEY}x"}, {"Authorization": ALICE_KEY}]
    for headers in cases:
        for method, path, body in (
                ("POST", "/v1/completions", completion()),
                ("POST", "/v1/chat/completions",
                 {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}]}),
                ("POST", "/v1/embeddings", {"model": EMBEDDER, "input": PROMPT}),
                ("GET", "/v1/models", None), ("DELETE", f"/v1/requests/{SECRET_ID}", None)):
            async with session.request(method, server.url + path, json=body,
                                       headers=headers) as resp:
                text = await resp.text()
                assert resp.status == 401, (headers, path, text)
                assert assert_error_shape(await resp.json())["code"] == "invalid_api_key"
                assert WRONG_KEY not in text and ALICE_KEY not in text and PROMPT not in text


async def test_other_tenants_request_id_is_invisible(server: Server,
                                                     session: aiohttp.ClientSession) -> None:
    url = server.url
    seen: list[str] = []  # what Bob got for requests that did not carry Alice's ID themselves

    async def bob(method: str, path: str, body: object = None,
                  headers: dict[str, str] | None = None) -> tuple[int, str]:
        async with session.request(method, url + path, json=body,
                                   headers={**BOB, **(headers or {})}) as resp:
            text = await resp.text()
            if SECRET_ID not in path + str(body) + str(headers):
                seen.append(text)
                seen.extend(f"{k}: {v}" for k, v in resp.headers.items())
            return resp.status, text

    async with session.post(url + "/v1/completions", json=completion(
            max_tokens=3000, ignore_eos=True, stream=True),
            headers={**ALICE, "X-Request-Id": SECRET_ID}) as alice_stream:
        assert alice_stream.status == 200
        await wait_state(session, url, lambda st: st["running"] >= 1)
        # Cancel: the same 404 as for an ID nobody ever used.
        status, text = await bob("DELETE", f"/v1/requests/{SECRET_ID}")
        unknown = f"never-used-{TAG}"
        status2, text2 = await bob("DELETE", f"/v1/requests/{unknown}")
        assert status == status2 == 404
        assert text.replace(SECRET_ID, "ID") == text2.replace(unknown, "ID")
        # Bob may use the same ID at the same time: no 409 that would reveal Alice's.
        status, text = await bob("POST", "/v1/completions", completion(),
                                 {"X-Request-Id": SECRET_ID})
        assert status == 200, text
        for path in ("/v1/state", "/metrics", "/v1/models", "/health", "/ready"):
            status, _ = await bob("GET", path)
            assert status == 200
        # Alice's own cancel works, and ends her stream.
        async with session.delete(url + f"/v1/requests/{SECRET_ID}", headers=ALICE) as resp:
            assert resp.status == 200
        events = [ev async for ev in sse_events(alice_stream)]
    last = [ev for ev in events if ev != "[DONE]"][-1]
    assert "error" in last or last["choices"][0]["finish_reason"] == "abort", last

    # Embeddings: request IDs are per tenant too, and a tenant's own duplicate is a 409.
    async def embed(headers: dict[str, str], n: int) -> int:
        async with session.post(url + "/v1/embeddings", json={"model": EMBEDDER,
                                                               "input": ["x"] * n},
                                headers={**headers, "X-Request-Id": SECRET_ID}) as resp:
            await resp.read()
            return resp.status

    # Each input is queued under "ID:index" until its batch is done: with 1000 inputs (32
    # batches) most of Alice's are still queued when the second request arrives.
    for other, expected in ((BOB, 200), (ALICE, 409)):
        first = asyncio.create_task(embed(ALICE, 1000))
        await asyncio.sleep(0.1)
        assert await embed(other, 1000) == expected
        assert await first == 200
    assert len(seen) > 5 and not [x for x in seen if SECRET_ID in x]


async def test_admin_routes_absent_from_public_listener(server: Server,
                                                        session: aiohttp.ClientSession) -> None:
    assert server.admin_url is not None
    # The admin key is no tenant's key (401 here); a tenant finds no such route (404).
    for headers, status in (({"Authorization": f"Bearer {ADMIN_KEY}"}, 401), (ALICE, 404),
                            ({}, 401)):
        for method, path in (("POST", "/admin/drain"), ("POST", "/admin/undrain"),
                             ("GET", "/admin/status")):
            async with session.request(method, server.url + path, headers=headers) as resp:
                assert resp.status == status, (method, path, resp.status)
                assert "admin" not in assert_error_shape(await resp.json())["message"].lower()
    async with session.get(server.url + "/ready") as resp:
        assert resp.status == 200  # nothing above drained the server
    async with session.get(server.admin_url + "/admin/status", headers=ALICE) as resp:
        assert resp.status == 401
    async with session.get(server.admin_url + "/admin/status",
                           headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:
        assert resp.status == 200


async def raw_exchange(port: int, head: bytes, body: bytes, wait: float = 5.0) -> bytes:
    """Send `head` + `body` and read what comes back within `wait` s, never sending more."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        data = b""
        deadline = time.monotonic() + wait
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < 40:
            chunk = await asyncio.wait_for(reader.read(4096), deadline - time.monotonic())
            if not chunk:
                break
            data += chunk
        return data
    finally:
        writer.close()


@pytest.mark.parametrize("auth", [True, False])
async def test_body_over_limit_is_413_before_it_is_read(server: Server, auth: bool) -> None:
    key = f"Authorization: Bearer {ALICE_KEY}\r\n".encode() if auth else b""
    # Announced as 50 MB; only 1 KB is ever sent: the answer must not wait for the rest.
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + key + b"Content-Length: 50000000\r\n\r\n")
    start = time.monotonic()
    data = await raw_exchange(server.port, head, b'{"prompt": "' + b"a" * 1000)
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert b"body_too_large" in data and time.monotonic() - start < 2
    # Chunked, so no length up front: refused once the limit is passed, the end never sent.
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + key + b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"a" * 8192
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(MAX_BODY // 8192 + 2))
    data = await raw_exchange(server.port, head, body)
    expected = b"HTTP/1.1 413" if auth else b"HTTP/1.1 401"  # no length to check before auth
    assert data.startswith(expected), data[:200]


async def test_no_secret_in_the_log(server: Server, session: aiohttp.ClientSession) -> None:
    """Runs last in this module: the log then holds everything the tests above sent too."""
    url = server.url
    # Successes, streams, 400s that quote fields, bad JSON, wrong keys, cancels, disconnects.
    async with session.post(url + "/v1/completions", json=completion()) as resp:
        assert resp.status == 401
    async with session.post(url + "/v1/completions", json=completion(), headers=ALICE) as resp:
        assert resp.status == 200
    async with session.post(url + "/v1/completions", json=completion(stream=True),
                            headers=BOB) as resp:
        assert resp.status == 200
        await resp.read()
    async with session.post(url + "/v1/chat/completions", headers=ALICE, json={
            "model": "tiny", "messages": [{"role": PROMPT, "content": PROMPT}]}) as resp:
        assert resp.status == 400
    async with session.post(url + "/v1/completions", headers=ALICE,
                            data=f'{{"prompt": "{PROMPT}", "max_tokens": }}') as resp:
        assert resp.status == 400
    async with session.post(url + "/v1/completions", headers=ALICE,
                            json=completion(max_tokens=-1, stop=PROMPT)) as resp:
        assert resp.status == 400
    async with session.post(url + "/v1/embeddings", headers=BOB,
                            json={"model": EMBEDDER, "input": [PROMPT]}) as resp:
        assert resp.status == 200
    async with session.post(url + "/v1/completions", json=completion(
            max_tokens=500, stream=True, ignore_eos=True), headers=ALICE) as resp:
        await resp.content.readline()  # then drop mid-stream
    # What aiohttp cannot parse (a control byte in the key's header line) and a body it cannot
    # decode after the answer: both used to land in the log with their raw bytes.
    await raw_exchange(server.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
                       b"Authorization: Bearer " + ALICE_KEY.encode() + b"\x01\r\n\r\n", b"")
    await raw_exchange(server.port, b"POST /v1/models HTTP/1.1\r\nHost: x\r\n"
                       b"Content-Encoding: deflate\r\nContent-Length: 9\r\n\r\n", b"\x00garbage")
    async with session.post(server.admin_url + "/admin/status",
                            headers={"Authorization": f"Bearer {WRONG_KEY}"}) as resp:
        assert resp.status == 401
    await asyncio.sleep(0.5)
    log = server.log()
    assert "INFO" in log  # the default level is on, so the check below means something
    for secret in (ALICE_KEY, BOB_KEY, WRONG_KEY, ADMIN_KEY, PROMPT, TAG):
        assert secret not in log, f"{secret!r} is in the server log:\n{log}"


# Slow clients: their own server, with a short header timeout so the test is quick. ----------

@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("frozen_gc")
async def test_slow_loris_is_cut_off_without_starving_others() -> None:
    timeout_s = 2.0
    with serve(*FAKE, "--fake-decode-step-ms", "5",
               env={"BATCHER_KEEPALIVE_TIMEOUT": str(timeout_s)}) as srv:
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   b"Content-Type: application/json\r\nX-Padding: " + b"p" * 400 + b"\r\n")

        async def normal_clients() -> list[float]:
            latencies = []
            async with aiohttp.ClientSession() as session:
                for i in range(40):
                    start = time.monotonic()
                    async with session.post(srv.url + "/v1/completions", json={
                            "model": "fake", "prompt": f"normal {i}", "max_tokens": 4}) as resp:
                        assert resp.status == 200
                        await resp.read()
                    latencies.append(time.monotonic() - start)
                    await asyncio.sleep(0.05)
            return latencies

        slow = [asyncio.create_task(trickle_headers(srv.port, request, timeout_s, silent=i % 5 == 0))
                for i in range(60)]
        latencies = await normal_clients()
        cut = await asyncio.gather(*slow)
    held = [t for t, _ in cut]
    print(f"60 slow-loris connections cut after {min(held):.2f}-{max(held):.2f}s (timeout "
          f"{timeout_s:g}s); 40 normal requests meanwhile: p99 "
          f"{percentile(latencies, 99) * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms")
    assert all(not got for _, got in cut), [g for _, g in cut if g][:2]  # never an answer
    assert max(held) < timeout_s + 1.5, held
    assert percentile(latencies, 99) < 0.5, latencies
