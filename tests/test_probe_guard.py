"""The replica's probe guard: keys, rate limit, one engine request for concurrent callers."""

from __future__ import annotations

import asyncio

import pytest

from batcher.http.errors import ApiError
from batcher.server.probe import ProbeGuard


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def status(guard: ProbeGuard, headers: dict[str, str]) -> int:
    try:
        guard.check(headers)
    except ApiError as err:
        return err.status
    return 200


def test_keys_and_rate_limit() -> None:
    clock = Clock()
    guard = ProbeGuard(("admin-k", None, "fleet-k"), rate=2.0, burst=3, clock=clock)
    assert status(guard, {}) == status(guard, auth("tenant-k")) == 401
    assert status(guard, {"Authorization": "Bearer \udcff"}) == 401  # odd bytes: no 500
    assert [status(guard, auth("admin-k")) for _ in range(3)] == [200] * 3
    assert status(guard, auth("fleet-k")) == 429
    clock.now += 0.5  # one token back at 2/s
    assert status(guard, auth("fleet-k")) == 200 and status(guard, auth("fleet-k")) == 429
    # Without keys nobody may probe: the probe runs ahead of every tenant.
    assert status(ProbeGuard((None, "")), auth("")) == 401


async def test_concurrent_callers_share_one_probe_and_leave_alone() -> None:
    guard = ProbeGuard(("k",))
    started = 0
    release = asyncio.Event()

    async def probe() -> float:
        nonlocal started
        started += 1
        await release.wait()
        return 0.25

    waiters = [asyncio.create_task(guard.run(probe, 5.0)) for _ in range(50)]
    await asyncio.sleep(0.01)
    assert started == 1
    waiters[0].cancel()  # one caller leaving does not end the probe for the others
    with pytest.raises(TimeoutError):
        await guard.run(probe, 0.01)  # a short deadline ends only its own wait
    release.set()
    results = await asyncio.gather(*waiters[1:])
    assert results == [0.25] * 49 and started == 1
    assert await guard.run(probe, 1.0) == 0.25 and started == 2  # the next one is fresh
