"""The request-ID registry: futures and streams by ID, dedupe, late results dropped."""

from __future__ import annotations

import asyncio

import pytest

from batcher.request_registry import (
    STREAM_END,
    DuplicateRequestId,
    RequestRegistry,
    StreamFailure,
    iter_stream,
    new_request_id,
)


def test_new_request_ids_are_unique_strings() -> None:
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(i.startswith("req-") for i in ids)


async def test_resolve_delivers_and_unregisters() -> None:
    reg = RequestRegistry()
    fut = reg.create_future("a")
    assert "a" in reg and len(reg) == 1
    assert reg.resolve("a", 42) is True
    assert await fut == 42
    assert "a" not in reg and len(reg) == 0
    # A second result for the same (finished) ID is dropped.
    assert reg.resolve("a", 43) is False


async def test_fail_raises_in_the_waiter() -> None:
    reg = RequestRegistry()
    fut = reg.create_future("a")
    assert reg.fail("a", RuntimeError("boom")) is True
    with pytest.raises(RuntimeError, match="boom"):
        await fut


async def test_unknown_ids_are_dropped_silently() -> None:
    reg = RequestRegistry()
    assert reg.resolve("nope", 1) is False
    assert reg.fail("nope", RuntimeError()) is False
    assert reg.push("nope", 1) is False
    assert reg.close_stream("nope") is False
    assert reg.cancel("nope") is False
    assert reg.discard("nope") is False


async def test_cancelled_request_drops_its_late_result() -> None:
    reg = RequestRegistry()
    fut = reg.create_future("a")
    assert reg.cancel("a") is True
    assert fut.cancelled()
    assert reg.resolve("a", 1) is False
    assert len(reg) == 0


async def test_result_for_a_caller_that_gave_up_is_dropped() -> None:
    reg = RequestRegistry()
    fut = reg.create_future("a")
    fut.cancel()  # e.g. the waiting task was cancelled
    assert reg.resolve("a", 1) is False
    assert "a" not in reg


async def test_repeated_in_flight_id_is_refused_and_reusable_after() -> None:
    reg = RequestRegistry()
    reg.create_future("a")
    with pytest.raises(DuplicateRequestId):
        reg.create_future("a")
    with pytest.raises(DuplicateRequestId):
        reg.create_stream("a")
    assert isinstance(DuplicateRequestId("x"), ValueError)
    reg.resolve("a", None)
    reg.create_future("a")  # finished IDs may be reused (a client retry)


async def test_bad_ids_are_refused() -> None:
    reg = RequestRegistry()
    with pytest.raises(ValueError):
        reg.create_future("")


async def test_discard_with_handle_spares_a_newer_entry() -> None:
    reg = RequestRegistry()
    old = reg.create_future("a")
    reg.discard("a", old)
    new = reg.create_future("a")
    assert reg.discard("a", old) is False  # the old attempt must not unregister the retry
    assert "a" in reg
    assert reg.discard("a", new) is True


async def test_stream_yields_items_then_ends() -> None:
    reg = RequestRegistry()
    queue = reg.create_stream("s")
    for i in range(3):
        assert reg.push("s", i) is True
    assert reg.close_stream("s") is True
    assert reg.push("s", 99) is False  # closed: later items dropped
    assert [x async for x in iter_stream(queue)] == [0, 1, 2]
    assert "s" not in reg


async def test_stream_failure_raises_after_earlier_items() -> None:
    reg = RequestRegistry()
    queue = reg.create_stream("s")
    reg.push("s", "tok")
    reg.fail("s", RuntimeError("engine died"))
    got = []
    with pytest.raises(RuntimeError, match="engine died"):
        async for x in iter_stream(queue):
            got.append(x)
    assert got == ["tok"]


async def test_stream_cancel_wakes_a_waiting_reader() -> None:
    reg = RequestRegistry()
    queue = reg.create_stream("s")

    async def read() -> list[object]:
        return [x async for x in iter_stream(queue)]

    reader = asyncio.create_task(read())
    await asyncio.sleep(0)
    assert reg.cancel("s") is True
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert isinstance(StreamFailure(RuntimeError()), StreamFailure)
    assert repr(STREAM_END) == "STREAM_END"
