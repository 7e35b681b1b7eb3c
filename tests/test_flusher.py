"""The size-or-timeout Flusher, driven by a hand-advanced clock (no real waiting, no timed asserts)."""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any

import pytest

from batcher.flusher.flusher import BatchError, Closed, Flusher, FlusherMetrics, Overloaded
from batcher.core.request_registry import DuplicateRequestId


class FakeClock:
    """A clock plus a matching `sleep`: sleepers wake only when `advance` passes their deadline."""

    def __init__(self) -> None:
        self.now = 0.0
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.now + seconds, fut))
        await fut

    def advance(self, seconds: float) -> None:
        self.now += seconds
        keep = []
        for deadline, fut in self._sleepers:
            if fut.done():
                continue
            if deadline <= self.now + 1e-12:
                fut.set_result(None)
            else:
                keep.append((deadline, fut))
        self._sleepers = keep


async def settle() -> None:
    """Let every ready task run until the loop is quiet (all fakes here are loop-only)."""
    for _ in range(50):
        await asyncio.sleep(0)


class Recorder:
    """An async batch function that records its batches and can be held at a gate."""

    def __init__(self, fn: Any = None) -> None:
        self.batches: list[list[Any]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fn = fn or (lambda items: [f"{x}-ok" for x in items])
        self.running = 0
        self.max_running = 0

    async def __call__(self, items: list[Any]) -> Any:
        self.batches.append(list(items))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await self.gate.wait()
            return self.fn(items)
        finally:
            self.running -= 1


def make(rec: Recorder, clock: FakeClock, **kw: Any) -> Flusher:
    kw.setdefault("max_wait_ms", 20)
    return Flusher(rec, clock=clock, sleep=clock.sleep, **kw)


def spawn(b: Flusher, items: list[Any], **kw: Any) -> list[asyncio.Task[Any]]:
    return [asyncio.create_task(b.submit(x, **kw)) for x in items]


async def test_flush_by_size() -> None:
    clock, rec = FakeClock(), Recorder()
    b = make(rec, clock, max_batch_size=4)
    tasks = spawn(b, [0, 1, 2, 3])
    assert await asyncio.gather(*tasks) == ["0-ok", "1-ok", "2-ok", "3-ok"]
    assert rec.batches == [[0, 1, 2, 3]]
    assert clock.now == 0.0  # no time needed to pass
    assert b.stats.flushes == {"size": 1, "time": 0, "close": 0}
    await b.close()


async def test_flush_by_time() -> None:
    clock, rec = FakeClock(), Recorder()
    b = make(rec, clock, max_batch_size=10)
    tasks = spawn(b, ["a", "b", "c"])
    await settle()
    clock.advance(0.019)
    await settle()
    assert rec.batches == [] and b.pending == 3
    clock.advance(0.001)
    assert await asyncio.gather(*tasks) == ["a-ok", "b-ok", "c-ok"]
    assert rec.batches == [["a", "b", "c"]]
    assert b.stats.flushes["time"] == 1
    await b.close()


async def test_the_101st_item_waits_for_the_next_batch() -> None:
    clock, rec = FakeClock(), Recorder()
    b = make(rec, clock, max_batch_size=100)
    tasks = spawn(b, list(range(101)))
    await asyncio.gather(*tasks[:100])
    await settle()
    assert [len(x) for x in rec.batches] == [100]
    assert not tasks[100].done() and b.pending == 1
    clock.advance(0.02)
    assert await tasks[100] == "100-ok"
    assert rec.batches[1] == [100]
    assert b.stats.flushes == {"size": 1, "time": 1, "close": 0}
    await b.close()


async def test_next_batch_fills_while_the_current_one_runs() -> None:
    clock, rec = FakeClock(), Recorder()
    rec.gate.clear()
    b = make(rec, clock, max_batch_size=2)
    tasks = spawn(b, [0, 1])
    await settle()
    tasks += spawn(b, [2, 3, 4])
    await settle()
    clock.advance(1.0)  # long past max_wait, but the one batch slot is busy
    await settle()
    assert rec.batches == [[0, 1]] and b.pending == 3 and b.in_flight == 1
    rec.gate.set()
    await asyncio.gather(*tasks)
    assert rec.batches == [[0, 1], [2, 3], [4]]
    assert rec.max_running == 1
    assert b.stats.flushes == {"size": 2, "time": 1, "close": 0}
    await b.close()


async def test_max_concurrent_batches_allows_overlap() -> None:
    clock, rec = FakeClock(), Recorder()
    rec.gate.clear()
    b = make(rec, clock, max_batch_size=2, max_queue=10, max_concurrent_batches=2)
    tasks = spawn(b, [0, 1, 2, 3, 4, 5])
    await settle()
    assert rec.batches == [[0, 1], [2, 3]] and b.in_flight == 2
    rec.gate.set()
    await asyncio.gather(*tasks)
    assert rec.max_running == 2
    await b.close()


async def test_full_queue_rejects_at_once_with_positive_retry_after() -> None:
    clock = FakeClock()

    def slow(items: list[Any]) -> list[Any]:
        clock.advance(0.2)  # the batch "takes" 200 ms on the fake clock
        return items

    rec = Recorder(slow)
    metrics = FlusherMetrics()
    b = make(rec, clock, max_batch_size=2, max_queue=4, metrics=metrics)
    assert b.retry_after() > 0  # before any batch was measured
    await asyncio.gather(*spawn(b, [0, 1]))
    rec.gate.clear()
    tasks = spawn(b, [2, 3])  # in flight, held at the gate
    await settle()
    tasks += spawn(b, [4, 5, 6, 7])  # fills the queue
    await settle()
    assert b.pending == 4
    with pytest.raises(Overloaded) as err:
        await b.submit(8)  # raises before it ever waits
    # 200 ms per batch x 2 batches queued.
    assert err.value.retry_after == pytest.approx(0.4)
    assert b.stats.rejected == 1
    assert metrics.registry.get_sample_value("batcher_flusher_rejections_total") == 1
    rec.gate.set()
    assert await asyncio.gather(*tasks) == [2, 3, 4, 5, 6, 7]
    await b.close()


async def test_retry_after_is_positive_with_zero_wait() -> None:
    b = Flusher(Recorder(), max_wait_ms=0)
    assert b.retry_after() > 0
    await b.close()


async def test_timed_out_item_never_reaches_fn() -> None:
    clock, rec = FakeClock(), Recorder()
    metrics = FlusherMetrics()
    b = make(rec, clock, max_batch_size=10, metrics=metrics)
    late = asyncio.create_task(b.submit("late", timeout=0.005))
    ok = asyncio.create_task(b.submit("ok"))
    await settle()
    clock.advance(0.005)
    with pytest.raises(TimeoutError):
        await late
    clock.advance(0.015)
    assert await ok == "ok-ok"
    assert rec.batches == [["ok"]]
    assert b.stats.timeouts == 1 and b.stats.removed_unflushed == 1
    assert metrics.registry.get_sample_value("batcher_flusher_timeouts_total") == 1
    await b.close()


async def test_default_timeout_applies() -> None:
    clock, rec = FakeClock(), Recorder()
    b = make(rec, clock, max_batch_size=10, max_wait_ms=100, timeout_ms=50)
    task = asyncio.create_task(b.submit("x"))
    await settle()
    clock.advance(0.05)
    with pytest.raises(TimeoutError):
        await task
    await b.close()
    assert rec.batches == []


async def test_late_result_is_dropped_and_a_retry_with_the_same_id_gets_its_own() -> None:
    clock, rec = FakeClock(), Recorder()
    rec.gate.clear()
    b = make(rec, clock, max_batch_size=1)
    first = asyncio.create_task(b.submit("old", request_id="r1", timeout=0.05))
    await settle()
    assert rec.batches == [["old"]]  # flushed, then the caller gives up
    clock.advance(0.05)
    with pytest.raises(TimeoutError):
        await first
    retry = asyncio.create_task(b.submit("new", request_id="r1"))
    await settle()
    rec.gate.set()
    assert await retry == "new-ok"
    assert b.stats.late_dropped == 1 and b.stats.completed == 1
    await b.close()


async def test_cancelled_caller_behaves_like_a_timeout() -> None:
    clock, rec = FakeClock(), Recorder()
    b = make(rec, clock, max_batch_size=10)
    gone = asyncio.create_task(b.submit("gone"))
    stay = asyncio.create_task(b.submit("stay"))
    await settle()
    gone.cancel()
    await settle()
    assert gone.cancelled() and b.pending == 1
    clock.advance(0.02)
    assert await stay == "stay-ok"
    assert rec.batches == [["stay"]]
    assert b.stats.cancelled == 1 and b.stats.removed_unflushed == 1
    await b.close()


async def test_failing_fn_fails_only_its_batch_and_the_next_succeeds() -> None:
    def fn(items: list[str]) -> list[str]:
        if "boom" in items:
            raise RuntimeError("model exploded")
        return [s.upper() for s in items]

    b = Flusher(fn, max_batch_size=2, max_wait_ms=1)  # sync: runs in the worker thread
    tasks = [asyncio.create_task(b.submit(s)) for s in ["boom", "x", "y", "z"]]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert [type(r) for r in results[:2]] == [RuntimeError, RuntimeError]
    assert results[2:] == ["Y", "Z"]
    assert b.stats.batch_errors == 1 and b.stats.failed == 2 and b.stats.completed == 2
    await b.close()


async def test_wrong_length_result_fails_the_batch_clearly() -> None:
    clock, rec = FakeClock(), Recorder(lambda items: items[:-1])
    b = make(rec, clock, max_batch_size=3)
    results = await asyncio.gather(*spawn(b, [1, 2, 3]), return_exceptions=True)
    assert all(isinstance(r, BatchError) for r in results)
    assert "2 results for 3 items" in str(results[0])
    await b.close()


async def test_results_land_on_the_right_callers_for_shuffled_inputs() -> None:
    clock, rec = FakeClock(), Recorder(lambda items: [x * 10 for x in items])
    b = make(rec, clock, max_batch_size=16, max_queue=200)
    order = list(range(200))
    random.Random(7).shuffle(order)
    tasks = {i: asyncio.create_task(b.submit(i, request_id=f"id-{i}")) for i in order}
    await settle()
    clock.advance(0.02)  # flush the tail
    for i, task in tasks.items():
        assert await task == i * 10
    assert [x for batch in rec.batches for x in batch] == order  # fn saw submit order
    await b.close()


async def test_a_thousand_concurrent_callers_each_get_their_own_answer() -> None:
    seen_threads: set[int] = set()

    def fn(items: list[int]) -> list[int]:
        seen_threads.add(threading.get_ident())
        return [x * 2 + 1 for x in items]

    async with Flusher(fn, max_batch_size=100, max_wait_ms=1, max_queue=1000) as b:
        results = await asyncio.gather(*(b.submit(i) for i in range(1000)))
    assert results == [i * 2 + 1 for i in range(1000)]
    assert b.stats.items_flushed == 1000 and b.stats.batches >= 10
    # One dedicated worker thread, never the event loop's.
    assert len(seen_threads) == 1 and threading.get_ident() not in seen_threads


async def test_close_drains_pending_then_refuses() -> None:
    clock, rec = FakeClock(), Recorder()
    b = make(rec, clock, max_batch_size=10, max_wait_ms=1000)
    tasks = spawn(b, [1, 2, 3])
    await settle()
    await b.close()  # no clock advance: close itself flushes
    assert [t.result() for t in tasks] == ["1-ok", "2-ok", "3-ok"]
    assert b.stats.flushes["close"] == 1
    with pytest.raises(Closed):
        await b.submit(4)
    await b.close()  # idempotent


async def test_repeated_in_flight_id_is_refused() -> None:
    clock, rec = FakeClock(), Recorder()
    b = make(rec, clock, max_batch_size=10)
    first = asyncio.create_task(b.submit("a", request_id="dup"))
    await settle()
    with pytest.raises(DuplicateRequestId):
        await b.submit("b", request_id="dup")
    clock.advance(0.02)
    assert await first == "a-ok"
    await b.close()


async def test_metrics_record_batches_waits_and_reasons() -> None:
    clock, rec = FakeClock(), Recorder()
    metrics = FlusherMetrics()
    b = make(rec, clock, max_batch_size=2, metrics=metrics)
    tasks = spawn(b, [1, 2, 3])
    await settle()
    clock.advance(0.02)
    await asyncio.gather(*tasks)
    get = metrics.registry.get_sample_value
    assert get("batcher_flusher_flushes_total", {"reason": "size"}) == 1
    assert get("batcher_flusher_flushes_total", {"reason": "time"}) == 1
    assert get("batcher_flusher_batch_size_count") == 2
    assert get("batcher_flusher_batch_size_sum") == 3
    assert get("batcher_flusher_queue_wait_seconds_count") == 3
    assert get("batcher_flusher_queue_wait_seconds_sum") == pytest.approx(0.02)
    assert get("batcher_flusher_service_seconds_count") == 2
    await b.close()


def test_bad_settings_are_refused() -> None:
    for kw in ({"max_batch_size": 0}, {"max_wait_ms": -1}, {"max_queue": 0}, {"timeout_s": 0}):
        with pytest.raises(ValueError):
            Flusher(Recorder(), **kw)


def test_documented_import_name_is_the_flusher() -> None:
    from batcher.flusher.flusher import Batcher

    assert Batcher is Flusher


def test_constructor_takes_one_unit_and_the_old_seconds_keyword_still_works() -> None:
    assert Flusher(Recorder(), timeout_ms=250).timeout_s == 0.25
    with pytest.warns(DeprecationWarning):
        assert Flusher(Recorder(), timeout_s=0.5).timeout_s == 0.5
    with pytest.raises(ValueError):
        Flusher(Recorder(), timeout_s=0.5, timeout_ms=500)
    with pytest.raises(ValueError):
        Flusher(Recorder(), timeout_ms=0)
