"""`batcher diagnose URL` after the traffic ended: a default window that sees nothing judges
everything since the server started and says so; and a replica shedding an overload is
reported as such (refused share, reasons, Retry-After given) before the phases of the few
requests it admitted."""

from __future__ import annotations

import asyncio

import pytest

from batcher.app.diagnose import SHEDDING_SHARE, diagnose_url
from batcher.engine.fake_runner import FakeSpeed
from tests.test_diagnose import ALICE, C, auth, fake_app, send, url

# What a window judges comes from measured phases: timed alone (`serial`).
pytestmark = [pytest.mark.serial, pytest.mark.usefixtures("frozen_gc")]


async def test_a_quiet_window_falls_back_to_everything_since_start(aiohttp_client) -> None:
    client = await aiohttp_client(fake_app(FakeSpeed(decode_step_s=0.005)))
    for i in range(3):
        await send(client, [300 + i] * 8, 20)
    d = await diagnose_url(url(client), 0.2, {})  # the traffic ended before the window
    assert d.requests == 3 and d.bottleneck == "decode", d.lines()
    assert d.note.startswith("no requests in the last 0.2 s; judging everything since")
    assert d.lines()[0] == d.note and d.to_json()["note"] == d.note


async def test_a_window_with_traffic_is_judged_alone(aiohttp_client) -> None:
    client = await aiohttp_client(fake_app(FakeSpeed(decode_step_s=0.005)))
    await send(client, [300] * 8, 20)

    async def later() -> None:
        await asyncio.sleep(0.05)
        for i in range(2):
            await send(client, [400 + i] * 8, 20)

    traffic = asyncio.create_task(later())
    d = await diagnose_url(url(client), 0.6, {})
    await traffic
    assert d.requests == 2 and not d.note, d.lines()


async def test_shedding_is_named_before_the_admitted_phases(aiohttp_client) -> None:
    # One sequence at a time, a queue of one: of a burst of 24, most are refused.
    client = await aiohttp_client(fake_app(FakeSpeed(decode_step_s=0.005), max_num_seqs=1,
                                           max_waiting=1))

    async def one(i: int) -> int:
        r = await client.post(C, json={"model": "fake", "prompt": [500 + i] * 8,
                                       "max_tokens": 20, "ignore_eos": True},
                              headers=auth(ALICE))
        await r.read()
        return r.status

    statuses = await asyncio.gather(*(one(i) for i in range(24)))
    admitted = statuses.count(200)
    d = await diagnose_url(url(client), 0, {})
    assert d.shedding and d.refusals["share"] >= SHEDDING_SHARE, d.lines()
    assert d.refusals["refused"] == 24 - admitted and d.requests == admitted
    assert d.refusals["reasons"] == {"queue_full": 24 - admitted}
    assert d.refusals["retry_after_s"] >= 1
    lines = d.lines()
    assert lines[0].startswith(f"overload: admission refused {24 - admitted} of 24 requests")
    assert "queue_full" in lines[0] and "Retry-After given: mean" in lines[0]
    assert lines[1].startswith(f"{url(client)}: {admitted} admitted requests")
    assert "shedding an overload" in d.action and d.to_json()["shedding"] is True
