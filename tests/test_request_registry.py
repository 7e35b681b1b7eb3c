"""The request-ID registry: futures and streams by ID, dedupe, late results dropped."""

from __future__ import annotations

import asyncio

import pytest

from batcher.core.request_registry import (
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


class _Delta:
    """An item that merges like an engine event: its parts follow the earlier item's."""

    def __init__(self, *parts: str) -> None:
        self.parts = list(parts)

    def absorb(self, later: _Delta) -> None:
        self.parts += later.parts


async def test_merged_items_reach_a_reader_that_fell_behind_as_one() -> None:
    reg = RequestRegistry()
    stream = reg.create_stream("s")
    for p in "abc":
        reg.push("s", _Delta(p), merge=True)
    reg.close_stream("s")
    got = [x.parts async for x in iter_stream(stream)]
    assert got == [["a", "b", "c"]]


async def test_paced_pushes_hold_a_reader_until_its_share_of_wakes() -> None:
    reg = RequestRegistry(wakes_per_s=1000.0)
    streams = [reg.create_stream(f"s{i}") for i in range(11)]  # each: a wake per 10 ms at most
    assert reg.hold_seconds() == pytest.approx(0.010)
    reader = asyncio.create_task(streams[0].get())
    await asyncio.sleep(0)
    reg.push("s0", _Delta("a"), merge=True, paced=True, now=100.0)  # never woken: not held
    assert (await reader).parts == ["a"]
    reader = asyncio.create_task(streams[0].get())
    await asyncio.sleep(0)
    reg.push("s0", _Delta("b"), merge=True, paced=True, now=100.004)
    reg.push("s0", _Delta("c"), merge=True, paced=True, now=100.008)
    await asyncio.sleep(0)
    assert not reader.done()  # held: woken 8 ms ago
    assert reg.release_held(100.009) == 0
    assert reg.release_held(100.011) == 1
    assert (await reader).parts == ["b", "c"]  # one wake, both tokens
    # An unpaced push (a first or a final item) wakes at once; a held reader is never lost.
    reader = asyncio.create_task(streams[0].get())
    await asyncio.sleep(0)
    reg.push("s0", _Delta("d"), merge=True, paced=True, now=100.012)
    reg.push("s0", _Delta("e"), merge=True, now=100.013)
    assert (await reader).parts == ["d", "e"]
    assert reg.release_held(200.0) == 0


async def test_a_reader_that_comes_back_takes_held_items_without_a_wake() -> None:
    reg = RequestRegistry(wakes_per_s=1.0)
    stream = reg.create_stream("s")
    reg.create_stream("t")
    reg.push("s", _Delta("a"), merge=True, now=5.0)
    reg.push("s", _Delta("b"), paced=True, now=5.1)  # held, not merged: two items
    assert stream.qsize() == 2
    assert (await stream.get()).parts == ["a"]
    assert (await stream.get()).parts == ["b"]
