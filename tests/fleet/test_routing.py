"""Routing over real replicas: a replica short of KV gets less, streams relayed unchanged,
request ids passed through, client disconnect and cancel reach the replica, stale heartbeats lose
preference."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from tests.fleet.procs import (
    FLEET,
    completion,
    free_port,
    replica,
    replica_view,
    router,
    running,
    served_by,
    stream,
    stream_text,
    wait_http,
    wait_routable,
)

pytestmark = pytest.mark.slow


async def replica_state(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(f"{url}/v1/state") as resp:
        return orjson.loads(await resp.read())


async def test_scarce_kv_streams_ids_and_cancellation():
    rport = free_port()
    rt = router(port=rport)
    url = f"http://127.0.0.1:{rport}"
    big = replica("big", router=rt.internal_url, num_blocks=1024, decode_ms=10)
    small = replica("small", router=rt.internal_url, num_blocks=24, decode_ms=10)
    with running(rt, big, small):
        wait_http(url + "/health", procs=(rt,))
        async with aiohttp.ClientSession() as s:
            await wait_routable(s, rt, 2)
            results = await asyncio.gather(*(completion(s, url, f"request {i}", 24)
                                             for i in range(40)))
            assert all(status == 200 for status, _ in results)
            counts = await served_by(s, rt)
            # Equally fast, so equal shares while both have KV to spare; the small one's
            # 24 blocks hold about 12 of these at once, and scarce KV adds to its wait (equal
            # shares, 20 and 20, would mean KV is ignored).
            assert counts.get("big", 0) >= 1.5 * counts.get("small", 0), counts

            # A stream passes through unchanged: same id, same text as the whole answer.
            status, whole = await completion(s, url, "tell me", 12, rid="client-id-1")
            assert status == 200 and whole["id"] == "cmpl-client-id-1"
            status, events = await stream(s, url, "tell me", 12, rid="client-id-2")
            assert status == 200 and events[-1] == "[DONE]"
            assert {e["id"] for e in events[:-1]} == {"cmpl-client-id-2"}
            assert stream_text(events) == whole["choices"][0]["text"]

            # Client disconnect: the replica stops the request and frees its KV.
            body = {"model": "fake", "prompt": "long one", "max_tokens": 4000, "stream": True,
                    "ignore_eos": True}
            async with s.post(f"{url}/v1/completions", data=orjson.dumps(body)) as resp:
                assert resp.headers["X-Attempt"] == "1"
                await resp.content.readline()
            await assert_idle(s, (big.url, small.url))

            # DELETE through the router reaches the replica that runs the id; no failover.
            async def cancel_soon() -> int:
                await asyncio.sleep(0.3)
                async with s.delete(f"{url}/v1/requests/to-cancel") as resp:
                    return resp.status

            (status, events), cancel_status = await asyncio.gather(
                stream(s, url, "cancel me", 4000, rid="to-cancel"), cancel_soon())
            assert cancel_status == 200 and status == 200
            # Cancelled by its owner: ended with finish_reason "abort", never resumed elsewhere.
            assert events[-2]["choices"][0]["finish_reason"] == "abort"
            assert events[-1] == "[DONE]" and "resumed" not in events[-2]
            await assert_idle(s, (big.url, small.url))


async def assert_idle(s: aiohttp.ClientSession, urls: tuple[str, ...]) -> None:
    deadline = time.monotonic() + 3.0
    while True:
        states = [await replica_state(s, u) for u in urls]
        if all(st["running"] == 0 and st["free_blocks"] == st["total_blocks"]
               for st in states):
            return
        assert time.monotonic() < deadline, states
        await asyncio.sleep(0.05)


async def test_stale_heartbeats_are_no_longer_preferred_after_three_seconds():
    rt = router()
    roomy = replica("roomy", num_blocks=1024, admin=False)
    tight = replica("tight", num_blocks=256, admin=False)
    with running(rt, roomy, tight):
        for p in (rt, roomy, tight):
            wait_http(p.url + "/health", procs=(p,))
        async with aiohttp.ClientSession() as s:
            seqs = {"roomy": 0, "tight": 0}

            async def beat(name: str, url: str, seq: int | None = None) -> bool:
                if seq is None:
                    seqs[name] = seq = seqs[name] + 1
                payload = dict(await replica_state(s, url), replica_id=name, url=url,
                               epoch=7, seq=seq)
                async with s.post(f"{rt.internal_url}/internal/heartbeat",
                                  data=orjson.dumps(payload), headers=FLEET) as resp:
                    return (await resp.json())["accepted"]

            async def beats(names: tuple[str, ...], seconds: float) -> None:
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    for name in names:
                        await beat(name, roomy.url if name == "roomy" else tight.url)
                    await asyncio.sleep(0.3)

            await beats(("roomy", "tight"), 1.0)
            assert not await beat("roomy", roomy.url, seq=1)  # a replayed beat is ignored
            before = await served_by(s, rt)
            for i in range(6):
                assert (await completion(s, rt.url, f"q{i}", 4))[0] == 200
            after = await served_by(s, rt)
            assert after.get("roomy", 0) - before.get("roomy", 0) == 6  # more free KV wins
            last_roomy_beat = time.monotonic()
            await beats(("tight",), 3.2)
            view = await replica_view(s, rt, "roomy")
            assert view["suspect"] and view["beat_age"] >= 3.0
            assert time.monotonic() - last_roomy_beat >= 3.2
            for i in range(6):
                assert (await completion(s, rt.url, f"r{i}", 4))[0] == 200
            final = await served_by(s, rt)
            assert final.get("roomy", 0) == after.get("roomy", 0), final
            assert final.get("tight", 0) - after.get("tight", 0) == 6
