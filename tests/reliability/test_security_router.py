"""Security of the router, mirroring the replica's suite (`test_security.py`): who may reach which
listener, a replica identity that cannot be hijacked, floods that cost little and evict nobody,
the probe as an operator's tool, request IDs scoped by caller, the replica's answer to every
malformed input (never a 500), slow clients cut off, and no secret in the router's log.

One fake replica (tenants alice and bob, an admin listener, the fleet key) behind one router
(`--replica URL,ADMIN_URL`, an internal listener with the fleet key, an admin listener), all on
127.0.0.1, started and stopped by this module. The router logs at info, so the secret check means
something.
"""

from __future__ import annotations

import asyncio
import http.client
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests.fleet.procs import ADMIN_KEY, FLEET_KEY, Proc, router, running, wait_http
from tests.reliability.conftest import FAKE, percentile
from tests.reliability.slow_client import trickle_headers
from tests.server_process import (
    Server,
    assert_error_shape,
    serve,
    sse_events,
    wait_state,
    write_tenants,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TAG = uuid.uuid4().hex[:12]
ALICE_KEY = f"alice-router-key-{TAG}"
BOB_KEY = f"bob-router-key-{TAG}"
WRONG_KEY = f"wrong-router-key-{TAG}"
PROMPT = f"confidential router prompt {TAG}"
SECRET_ID = f"alice-router-request-{TAG}"
ALICE = {"Authorization": f"Bearer {ALICE_KEY}"}
BOB = {"Authorization": f"Bearer {BOB_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
FLEET = {"Authorization": f"Bearer {FLEET_KEY}"}
MAX_REPLICAS = 8


@dataclass(slots=True)
class Fleet:
    replica: Server
    router: Proc
    replica_id: str


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    path = write_tenants(Path(tmp_path_factory.mktemp("router-security")) / "tenants.toml", {
        "alice": {"key": ALICE_KEY, "tokens_per_minute": 1e7, "max_concurrent": 64},
        "bob": {"key": BOB_KEY, "tokens_per_minute": 1e7, "max_concurrent": 64}})
    with serve(*FAKE, "--fake-decode-step-ms", "5", "--tenants", str(path),
               admin_key=ADMIN_KEY, env={"BATCHER_FLEET_KEY": FLEET_KEY}) as rep:
        rt = router("--log-level", "info", "--max-replicas", str(MAX_REPLICAS),
                    replicas=(f"{rep.url},{rep.admin_url}",))
        with running(rt):
            wait_http(rt.url + "/health", procs=(rt,))
            deadline = time.monotonic() + 30
            while raw(rt.port, "GET", "/ready", []).status != 200:  # a health round saw it
                assert time.monotonic() < deadline, rt.tail()
                time.sleep(0.1)
            yield Fleet(rep, rt, f"127.0.0.1:{rep.port}")


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def completion(**kw: object) -> dict[str, object]:
    return {"model": "fake", "prompt": PROMPT, "max_tokens": 4, **kw}


def beat(replica_id: str, url: str, epoch: int = 1, seq: int = 1) -> bytes:
    return orjson.dumps({"free_blocks": 100, "total_blocks": 100, "block_size": 16,
                         "running": 0, "waiting": 0, "version": "v1", "draining": False,
                         "healthy": True, "replica_id": replica_id, "url": url,
                         "epoch": epoch, "seq": seq, "admin_url": "http://127.0.0.1:9/"})


@dataclass(slots=True)
class Raw:
    status: int
    body: bytes

    def code(self) -> str | None:
        if self.status < 400:
            return None
        try:
            return assert_error_shape(orjson.loads(self.body))["code"]
        except orjson.JSONDecodeError:
            return None


def raw(port: int, method: str, path: str, headers: list[tuple[str, str | bytes]],
        body: bytes | None = None) -> Raw:
    """One request sent byte for byte as given (non-UTF-8 header values included)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers:
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return Raw(resp.status, resp.read())
    finally:
        conn.close()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_each_listener_serves_only_its_callers(fleet: Fleet,
                                                     session: aiohttp.ClientSession) -> None:
    rt = fleet.router
    # Heartbeats and admin routes are not on the public listener at all.
    for method, path in (("POST", "/internal/heartbeat"), ("POST", "/admin/drain"),
                         ("GET", "/admin/status")):
        for headers in ({}, FLEET, ADMIN, ALICE):
            async with session.request(method, rt.url + path, headers=headers) as resp:
                assert resp.status == 404, (path, headers)
                assert_error_shape(await resp.json())
    # The internal listener takes the fleet key only; the admin listener the admin key only.
    for url, good in ((f"{rt.internal_url}/internal/heartbeat", FLEET),
                      (f"{rt.admin_url}/admin/status", ADMIN)):
        for headers in ({}, ALICE, ADMIN if good is FLEET else FLEET,
                        {"Authorization": "Bearer "}):
            async with session.post(url, headers=headers, data=b"{}") as resp:
                assert resp.status in (401, 405), (url, headers, resp.status)
                assert assert_error_shape(await resp.json())["code"] in (
                    "invalid_api_key", "method_not_allowed")
    # Public capacity names no replica address; models need a tenant key, as on a replica.
    async with session.get(rt.url + "/v1/state") as resp:
        text = await resp.text()
        assert resp.status == 200 and str(fleet.replica.port) not in text, text
    async with session.get(rt.url + "/v1/models") as resp:
        assert resp.status == 401
    async with session.get(rt.url + "/v1/models", headers=ALICE) as resp:
        assert resp.status == 200 and (await resp.json())["data"][0]["id"] == "fake"


async def test_a_beat_cannot_repoint_a_replica(fleet: Fleet,
                                               session: aiohttp.ClientSession) -> None:
    """The hijack: one beat reusing a live replica's id with the attacker's URL. Without the key
    it is a 401; with it (a stolen key) a 409, logged; either way traffic stays put."""
    rt, rid = fleet.router, fleet.replica_id
    evil = "http://127.0.0.1:9"
    target = f"{rt.internal_url}/internal/heartbeat"
    async with session.post(target, data=beat(rid, evil)) as resp:
        assert resp.status == 401
    async with session.post(target, data=beat(rid, evil, epoch=2), headers=FLEET) as resp:
        assert resp.status == 409, await resp.text()
        assert assert_error_shape(await resp.json())["code"] == "heartbeat_refused"
    async with session.get(f"{rt.admin_url}/admin/status", headers=ADMIN) as resp:
        view = next(r for r in (await resp.json())["replicas"] if r["replica_id"] == rid)
    assert view["url"] == fleet.replica.url and view["routable"]
    for _ in range(5):
        async with session.post(rt.url + "/v1/completions", json=completion(),
                                headers=ALICE) as resp:
            assert resp.status == 200
    await asyncio.sleep(0.2)
    assert "refused" in rt.tail(20000) and rid in rt.tail(20000)


async def test_the_probe_is_an_operators_tool(fleet: Fleet,
                                             session: aiohttp.ClientSession) -> None:
    rt, rep = fleet.router, fleet.replica
    for url in (rt.url, rep.url):
        for headers in ({}, ALICE, {"Authorization": f"Bearer {WRONG_KEY}"}):
            async with session.post(url + "/v1/probe", headers=headers) as resp:
                assert resp.status == 401, (url, headers)
    # The router answers from its own health checks; nothing goes upstream.
    async with session.post(rt.url + "/v1/probe", headers=ADMIN) as resp:
        body = await resp.json()
        assert resp.status == 200 and body["ok"] and "latency_ms" not in body, body
    # On the replica: rate-limited, and concurrent probes share one engine request, so 200 of
    # them never push a tenant's request into queue_full.
    async def probe() -> int:
        async with session.post(rep.url + "/v1/probe?timeout=5", headers=FLEET) as resp:
            await resp.read()
            return resp.status

    probes = asyncio.gather(*(probe() for _ in range(200)))
    async with session.post(rep.url + "/v1/completions", json=completion(),
                            headers=ALICE) as resp:
        assert resp.status == 200
    statuses = await probes
    print(f"200 concurrent probes: {statuses.count(200)} answered 200, "
          f"{statuses.count(429)} refused 429")
    assert set(statuses) <= {200, 429} and statuses.count(200) <= 20, statuses
    assert statuses.count(429) >= 150


async def test_request_ids_are_scoped_by_caller(fleet: Fleet,
                                                session: aiohttp.ClientSession) -> None:
    url = fleet.router.url
    async with session.post(url + "/v1/completions", json=completion(
            max_tokens=3000, ignore_eos=True, stream=True),
            headers={**ALICE, "X-Request-Id": SECRET_ID}) as alice_stream:
        assert alice_stream.status == 200
        await wait_state(session, fleet.replica.url, lambda st: st["running"] >= 1)
        unknown = f"never-used-{TAG}"
        answers = []
        for rid in (SECRET_ID, unknown):
            async with session.delete(f"{url}/v1/requests/{rid}", headers=BOB) as resp:
                answers.append((resp.status, (await resp.text()).replace(rid, "ID")))
        assert answers[0] == answers[1] and answers[0][0] == 404, answers
        # Anonymous: the replica's 401 whatever the id, so no oracle.
        for rid in (SECRET_ID, unknown):
            async with session.delete(f"{url}/v1/requests/{rid}") as resp:
                assert resp.status == 401
        # Bob may use the same id meanwhile, and it does not take Alice's away.
        async with session.post(url + "/v1/completions", json=completion(),
                                headers={**BOB, "X-Request-Id": SECRET_ID}) as resp:
            assert resp.status == 200
        async with session.delete(f"{url}/v1/requests/{SECRET_ID}", headers=ALICE) as resp:
            assert resp.status == 200, await resp.text()
        events = [ev async for ev in sse_events(alice_stream)]
    last = [ev for ev in events if ev != "[DONE]"][-1]
    assert "error" in last or last["choices"][0]["finish_reason"] == "abort", last


def _parity_cases(alice: str) -> list[tuple[str, str, list[tuple[str, str | bytes]],
                                            bytes | None]]:
    auth = ("Authorization", f"Bearer {alice}")
    js = ("Content-Type", "application/json")
    chat = "/v1/chat/completions"
    return [
        ("POST", chat, [auth, js], b'{"model": "fake", "messages": 5}'),
        ("POST", chat, [auth, js], orjson.dumps({"model": "fake", "messages": [
            {"role": "user", "content": [{"type": "text", "text": 5}]}]})),
        ("POST", chat, [auth, js], orjson.dumps({"model": "fake", "messages": [
            {"role": "user", "content": [{"type": "text", "text": None}]}]})),
        ("POST", "/v1/completions", [auth, js, ("Content-Encoding", "deflate")],
         b"\x00 not deflate at all"),
        ("POST", "/v1/completions", [auth, js, ("Content-Encoding", "deflate")],
         zlib.compress(orjson.dumps(completion()))),
        ("GET", "/v1/models", [auth, ("Expect", b"\xff\xfe")], None),
        ("GET", "/v1/models", [auth, ("Expect", "something-else")], None),
        ("POST", "/v1/completions", [auth, js, ("Expect", "100-continue")],
         orjson.dumps(completion())),
        ("GET", "/v1/models", [("Authorization", b"Bearer \xff\xfe\xfd")], None),
        ("GET", "/v1/models", [auth, ("Authorization", f"Bearer {WRONG_KEY}")], None),
        ("GET", "/v1/models", [("Authorization", f"bearer {alice}")], None),
        ("GET", "/v1/models", [auth, ("X-Request-Id", "not an id")], None),
        ("POST", "/v1/completions", [auth, js], orjson.dumps(completion(model="m" * 2**20))),
        ("POST", "/v1/completions", [auth, js], orjson.dumps(completion(
            prompt=["a"] * 800_000))),
        ("POST", "/v1/completions", [auth, js], b'{"model": "fake", "prompt": '),
        ("DELETE", "/v1/requests/%ff", [auth], None),
        ("GET", "/no/such/route", [auth], None),
        ("PUT", "/v1/completions", [auth], None),
    ]


# The flood leaves keyed, unreachable replicas registered (never routable: the router never
# reached them) until they are forgotten.
async def test_a_heartbeat_flood_costs_little_and_evicts_nobody(
        fleet: Fleet, session: aiohttp.ClientSession) -> None:
    """2,000 beats (half without the key, half with it under fresh ids) while tenants work:
    every tenant request succeeds, the registry stays under its cap, the replica stays."""
    rt = fleet.router
    target = f"{rt.internal_url}/internal/heartbeat"
    statuses: dict[int, int] = {}
    sem = asyncio.Semaphore(100)

    async def one(i: int) -> None:
        headers = FLEET if i % 2 else {}
        async with sem, session.post(target, headers=headers,
                                     data=beat(f"fake-{TAG}-{i}", f"http://127.9.{i % 250}.1:1")
                                     ) as resp:
            await resp.read()
            statuses[resp.status] = statuses.get(resp.status, 0) + 1

    async def tenants() -> list[float]:
        latencies = []
        for i in range(20):
            start = time.monotonic()
            async with session.post(rt.url + "/v1/completions", headers=BOB,
                                    json=completion(prompt=f"during the flood {i}")) as resp:
                assert resp.status == 200, await resp.text()
            latencies.append(time.monotonic() - start)
        return latencies

    start = time.monotonic()
    flood = asyncio.gather(*(one(i) for i in range(2000)))
    latencies, _ = await asyncio.gather(tenants(), flood)
    took = time.monotonic() - start
    async with session.get(f"{rt.admin_url}/admin/status", headers=ADMIN) as resp:
        replicas = (await resp.json())["replicas"]
    print(f"2000 beats in {took:.1f}s: {statuses}; tenant p99 during the flood "
          f"{percentile(latencies, 99) * 1000:.0f} ms; {len(replicas)} replicas registered")
    assert set(statuses) <= {200, 401, 429, 503}, statuses
    # At most the cap's free places were taken; the rest was refused cheaply (rate limit first,
    # then the key, then the cap).
    assert statuses.get(200, 0) <= MAX_REPLICAS - 1 and statuses.get(429, 0) > 0, statuses
    assert len(replicas) <= MAX_REPLICAS
    real = next(r for r in replicas if r["replica_id"] == fleet.replica_id)
    assert real["routable"] and not real["evicted"]
    # The keyed beats named addresses this router never reached: none of them drew traffic.
    flooded = [r for r in replicas if r["replica_id"] != fleet.replica_id]
    assert flooded and not any(r["routable"] for r in flooded), flooded


def test_router_answers_malformed_input_as_the_replica_does(fleet: Fleet) -> None:
    for method, path, headers, body in _parity_cases(ALICE_KEY):
        start = time.monotonic()
        got = raw(fleet.router.port, method, path, headers, body)
        router_s = time.monotonic() - start
        want = raw(fleet.replica.port, method, path, headers, body)
        case = (method, path, headers, (body or b"")[:60])
        assert got.status == want.status and got.code() == want.code(), (case, got, want)
        assert got.status < 500, case
        assert len(got.body) < 4096, case  # nothing echoed back at length
        assert router_s < 2.0, (case, router_s)  # limits checked before expensive work
    # Admin listeners: odd bytes and a lowercase scheme, as on the replica's.
    for port, path in ((port_of(fleet.router.admin_url), "/admin/status"),
                       (port_of(fleet.replica.admin_url), "/admin/status")):
        assert raw(port, "GET", path, [("Authorization", b"Bearer \xff\xfe")]).status == 401
        assert raw(port, "GET", path, [("Authorization", f"bearer {ADMIN_KEY}")]).status == 200
        assert raw(port, "GET", path, [("Authorization", f"Bearer {ADMIN_KEY}"),
                                       ("Authorization", f"Bearer {ADMIN_KEY}")]).status == 401
    hb = port_of(fleet.router.internal_url)
    for value in (b"Bearer \xff\xfe", b"\x80"):
        ans = raw(hb, "POST", "/internal/heartbeat", [("Authorization", value)], b"{}")
        assert ans.status == 401 and ans.code() == "invalid_api_key", ans
    ans = raw(hb, "POST", "/internal/heartbeat", [*FLEET.items(), ("Expect", b"\xff")],
              b"[]")
    assert ans.status == 400, ans


@pytest.mark.timeout(60)
async def test_slow_loris_is_cut_off_by_the_router() -> None:
    timeout_s = 2.0
    rt = router(env={"BATCHER_KEEPALIVE_TIMEOUT": str(timeout_s)})
    with running(rt):
        wait_http(rt.url + "/health", procs=(rt,))
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"p" * 200

        async def normal() -> list[float]:
            out = []
            async with aiohttp.ClientSession() as s:
                for _ in range(20):
                    start = time.monotonic()
                    async with s.get(rt.url + "/health") as resp:
                        assert resp.status == 200
                    out.append(time.monotonic() - start)
                    await asyncio.sleep(0.05)
            return out

        tasks = [asyncio.create_task(trickle_headers(rt.port, head, timeout_s, silent=i % 5 == 0))
                 for i in range(40)]
        latencies = await normal()
        cut = await asyncio.gather(*tasks)
    held = [t for t, _ in cut]
    print(f"40 slow-loris connections cut by the router after {min(held):.2f}-{max(held):.2f}s "
          f"(timeout {timeout_s:g}s); /health meanwhile p99 "
          f"{percentile(latencies, 99) * 1000:.0f} ms")
    assert all(not got for _, got in cut)
    assert max(held) < timeout_s + 1.5, held


async def test_no_secret_in_the_router_log(fleet: Fleet,
                                           session: aiohttp.ClientSession) -> None:
    """Runs last in this module: the log then holds everything the tests above sent too."""
    url = fleet.router.url
    async with session.post(url + "/v1/completions", json=completion(), headers=ALICE) as resp:
        assert resp.status == 200
    async with session.post(url + "/v1/completions", json=completion(stream=True),
                            headers=BOB) as resp:
        await resp.read()
    async with session.post(url + "/v1/chat/completions", headers=ALICE, json={
            "model": "fake", "messages": [{"role": PROMPT, "content": PROMPT}]}) as resp:
        assert resp.status == 400
    async with session.post(url + "/v1/completions", headers={
            "Authorization": f"Bearer {WRONG_KEY}"}, json=completion()) as resp:
        assert resp.status == 401
    raw(fleet.router.port, "GET", "/v1/models",
        [("Authorization", f"Bearer {ALICE_KEY}".encode() + b"\x01")])
    await asyncio.sleep(0.5)
    log = fleet.router.tail(10**7)
    assert "INFO" in log or "WARNING" in log, log[-2000:]
    for secret in (ALICE_KEY, BOB_KEY, WRONG_KEY, ADMIN_KEY, FLEET_KEY, PROMPT):
        assert secret not in log, f"{secret!r} is in the router log"
    assert "Traceback" not in log, log[-3000:]
