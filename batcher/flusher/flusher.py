"""The size-or-timeout flusher for fixed-shape work (embeddings, classifiers).

Callers `await flusher.submit(item)`; a background task flushes pending items into one call of
`fn(items) -> results` when `max_batch_size` items wait or the oldest has waited `max_wait_ms`,
whichever comes first, and resolves each caller's future with the result at its item's position.

Contracts:
- Never an empty flush. At most `max_concurrent_batches` calls of `fn` run at once (1 by default);
  the next batch fills while the current one runs and flushes as soon as the slot frees.
- A sync `fn` runs in a dedicated worker thread (the event loop never blocks); an async `fn` is awaited.
- An exception from `fn` fails exactly that batch's callers; a wrong-length result fails them with
  `BatchError`.
- With `max_queue` items unflushed, `submit` raises `Overloaded(retry_after)` at once.
- A caller that times out gets `TimeoutError`, a cancelled one `CancelledError`; either way its item is
  removed if not yet flushed (it never reaches `fn`) and a late result is dropped.
- `close()` drains: new submits raise `Closed`, pending items are flushed, then the task stops.
- `clock` and `sleep` are injectable, so tests drive every timer by hand.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
import warnings
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, Self, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram

from batcher.core.request_registry import RequestRegistry, new_request_id

ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")
# `fn(items) -> results`, one result per item in order; sync (run in a worker thread) or async.
BatchFn = Callable[[list[ItemT]], Sequence[ResultT] | Awaitable[Sequence[ResultT]]]

# A deadline this close counts as due, so float round-off never costs a second (fake-clock) sleep.
_DUE_EPSILON_S = 1e-6
# Floor of a Retry-After hint: a client is always told to wait a little.
_MIN_RETRY_AFTER_S = 0.001
# Weight of the newest batch time in the moving average behind Retry-After.
_EWMA_ALPHA = 0.2
_SIZES = (1, 2, 4, 8, 16, 32, 64, 100, 128, 256, 512, 1024)


class Overloaded(Exception):
    """The queue is full; `retry_after` (seconds, > 0) estimates when it will have drained."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"batcher queue is full; retry after {retry_after:.3f} s")
        self.retry_after = retry_after


class Closed(RuntimeError):
    """`submit` after `close()`."""


class BatchError(RuntimeError):
    """The batch function broke its contract (not one result per item)."""


class FlusherMetrics:
    """Prometheus metrics for Flushers. Several Flushers may share one instance; a registry accepts
    each name once. `registry` defaults to a fresh one, so Flushers built in tests never collide."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = reg = registry if registry is not None else CollectorRegistry()
        p = "batcher_flusher_"
        self.batch_size = Histogram(
            p + "batch_size", "Items per batch", buckets=_SIZES, registry=reg
        )
        self.queue_wait = Histogram(p + "queue_wait_seconds", "Submit to flush", registry=reg)
        self.service = Histogram(p + "service_seconds", "One batch call", registry=reg)
        self.flushes = Counter(p + "flushes", "Batches by flush reason", ["reason"], registry=reg)
        self.timeouts = Counter(p + "timeouts", "Callers that timed out", registry=reg)
        self.rejections = Counter(p + "rejections", "Submits refused as Overloaded", registry=reg)


@dataclass(slots=True)
class FlusherStats:
    """In-process counters for tests and benchmarks (Prometheus has the same in `metrics`)."""

    submitted: int = 0
    completed: int = 0
    failed: int = 0
    rejected: int = 0
    timeouts: int = 0
    cancelled: int = 0
    removed_unflushed: int = 0
    late_dropped: int = 0
    batches: int = 0
    batch_errors: int = 0
    items_flushed: int = 0
    flushes: dict[str, int] = field(default_factory=lambda: {"size": 0, "time": 0, "close": 0})


@dataclass(slots=True)
class _Entry:
    request_id: str
    item: Any
    future: asyncio.Future[Any]
    enqueued_at: float


class Flusher(Generic[ItemT, ResultT]):
    """Size-or-timeout flusher around `fn`; the module docstring states the contract.
    `Flusher[str, list[float]]` takes `str` items and resolves each to a `list[float]`.

    Bound to the event loop of its first `submit`.
    """

    def __init__(
        self,
        fn: BatchFn[ItemT, ResultT],
        max_batch_size: int = 100,
        max_wait_ms: float = 20,
        max_queue: int | None = None,
        timeout_s: float | None = None,  # deprecated: use timeout_ms (one unit per constructor)
        clock: Callable[[], float] = time.monotonic,
        metrics: FlusherMetrics | None = None,
        *,
        timeout_ms: float | None = None,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        max_concurrent_batches: int = 1,
    ) -> None:
        max_queue = 2 * max_batch_size if max_queue is None else max_queue
        if timeout_s is not None:
            if timeout_ms is not None:
                raise ValueError("give timeout_ms or the older timeout_s, not both")
            warnings.warn("Flusher(timeout_s=...) is deprecated; use timeout_ms",
                          DeprecationWarning, stacklevel=2)
            timeout_ms = timeout_s * 1000.0
        for ok, what in (
            (max_batch_size >= 1, "max_batch_size must be >= 1"),
            (max_wait_ms >= 0, "max_wait_ms must be >= 0"),
            (max_queue >= 1, "max_queue must be >= 1"),
            (timeout_ms is None or timeout_ms > 0, "timeout_ms must be > 0"),
            (max_concurrent_batches >= 1, "max_concurrent_batches must be >= 1"),
        ):
            if not ok:
                raise ValueError(what)
        self._fn = fn
        # An object with an `async def __call__` counts as async too.
        call = type(fn).__call__
        self._is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_queue = max_queue
        self.timeout_s = None if timeout_ms is None else timeout_ms / 1000.0
        self.max_concurrent_batches = max_concurrent_batches
        self._clock, self._sleep = clock, sleep
        self.metrics = metrics if metrics is not None else FlusherMetrics()
        self.stats = FlusherStats()
        self._registry = RequestRegistry()
        # Insertion-ordered, and O(1) to pop from the front or the middle (a caller that gave up).
        self._pending: OrderedDict[str, _Entry] = OrderedDict()
        self._inflight = 0
        self._batch_time_s: float | None = None
        self._closing = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._batch_tasks: set[asyncio.Task[None]] = set()
        self._executor = (
            None
            if self._is_async
            else ThreadPoolExecutor(max_concurrent_batches, thread_name_prefix="batcher-fn")
        )

    @property
    def pending(self) -> int:
        """Items submitted and not yet flushed."""
        return len(self._pending)

    @property
    def in_flight(self) -> int:
        """Batches whose `fn` call is running."""
        return self._inflight

    def retry_after(self) -> float:
        """Seconds until the queue drains: measured batch time (EWMA) x queue depth in batches."""
        per_batch = self._batch_time_s if self._batch_time_s is not None else self.max_wait_s
        depth = max(1, math.ceil(len(self._pending) / self.max_batch_size))
        return max(per_batch * depth, _MIN_RETRY_AFTER_S)

    async def submit(
        self, item: ItemT, request_id: str | None = None, timeout: float | None = None
    ) -> ResultT:
        """Queue `item` and return its result.

        Raises `Closed`, `Overloaded`, `DuplicateRequestId` (`request_id` already in flight),
        `TimeoutError` after `timeout` seconds (default the constructor's `timeout_ms`; None waits for ever), or what
        `fn` raised for this item's batch.
        """
        if self._closing:
            raise Closed("batcher is closed")
        if len(self._pending) >= self.max_queue:
            self.stats.rejected += 1
            self.metrics.rejections.inc()
            raise Overloaded(self.retry_after())
        rid = request_id if request_id is not None else new_request_id()
        fut = self._registry.create_future(rid)
        entry = _Entry(rid, item, fut, self._clock())
        self._pending[rid] = entry
        self.stats.submitted += 1
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        n = len(self._pending)
        # Only a new oldest item (a new deadline) or a full batch changes what the loop waits for.
        if n == 1 or n == self.max_batch_size:
            self._wake.set()
        wait = timeout if timeout is not None else self.timeout_s
        try:
            if wait is None:
                return await fut
            await self._wait_or_sleep(fut, wait)
            if fut.done():
                return fut.result()
            self._abandon(entry)
            self.stats.timeouts += 1
            self.metrics.timeouts.inc()
            raise TimeoutError(f"request {rid} timed out after {wait:.3f} s")
        except asyncio.CancelledError:
            self._abandon(entry)
            self.stats.cancelled += 1
            raise
        finally:
            self._registry.discard(rid, fut)

    async def close(self) -> None:
        """Refuse new items, flush everything pending, wait for running batches, then stop."""
        if not self._closing:
            self._closing = True
            self._wake.set()
        if self._task is not None:
            await self._task
        if self._executor is not None:
            self._executor.shutdown(wait=False)  # every batch has finished: the thread is idle

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- the flush loop (the only place that starts batches) -------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                reason = self._flush_reason()
                if reason is not None:
                    self._launch(reason)
                elif self._closing and not self._pending and not self._inflight:
                    return
                elif not self._pending or self._inflight >= self.max_concurrent_batches:
                    await self._wake.wait()  # only a submit or a finished batch changes things
                else:
                    oldest = next(iter(self._pending.values()))
                    due_in = oldest.enqueued_at + self.max_wait_s - self._clock()
                    waiter = asyncio.ensure_future(self._wake.wait())
                    try:
                        await self._wait_or_sleep(waiter, due_in)
                    finally:
                        waiter.cancel()
        except BaseException as exc:
            # A bug here must not strand callers on futures nobody would resolve.
            self._closing = True
            err = exc if isinstance(exc, Exception) else Closed("batcher stopped")
            for entry in self._pending.values():
                if not entry.future.done():
                    entry.future.set_exception(err)
            self._pending.clear()
            raise

    def _flush_reason(self) -> str | None:
        """Why to flush now ('size' | 'close' | 'time'), or None to keep waiting."""
        if not self._pending or self._inflight >= self.max_concurrent_batches:
            return None
        if len(self._pending) >= self.max_batch_size:
            return "size"
        if self._closing:
            return "close"
        oldest = next(iter(self._pending.values()))
        if self._clock() - oldest.enqueued_at >= self.max_wait_s - _DUE_EPSILON_S:
            return "time"
        return None

    async def _wait_or_sleep(self, fut: asyncio.Future[Any], timeout: float) -> None:
        """Wait until `fut` is done or `timeout` seconds pass on the injected sleep."""
        if fut.done():
            return
        sleeper = asyncio.ensure_future(self._sleep(timeout))
        try:
            await asyncio.wait((fut, sleeper), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()

    def _launch(self, reason: str) -> None:
        now = self._clock()
        entries: list[_Entry] = []
        while self._pending and len(entries) < self.max_batch_size:
            entry = self._pending.popitem(last=False)[1]
            if not entry.future.done():  # cancelled by ID, caller not yet woken: nobody waits
                entries.append(entry)
        if not entries:
            return
        self._inflight += 1
        self.stats.batches += 1
        self.stats.items_flushed += len(entries)
        self.stats.flushes[reason] += 1
        self.metrics.flushes.labels(reason=reason).inc()
        self.metrics.batch_size.observe(len(entries))
        for entry in entries:
            self.metrics.queue_wait.observe(now - entry.enqueued_at)
        task = asyncio.get_running_loop().create_task(self._run_batch(entries))
        self._batch_tasks.add(task)  # a strong reference until it finishes
        task.add_done_callback(self._batch_tasks.discard)

    async def _run_batch(self, entries: list[_Entry]) -> None:
        items = [entry.item for entry in entries]
        started = self._clock()
        try:
            if self._is_async:
                raw = await self._fn(items)  # type: ignore[misc]
            else:
                raw = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._fn, items
                )
            results = _as_results(raw, len(items))
        except BaseException as exc:
            self.stats.batch_errors += 1
            err = exc if isinstance(exc, Exception) else Closed("batch interrupted")
            for entry in entries:
                self._settle(entry, err, failed=True)
            if not isinstance(exc, Exception):
                raise
        else:
            for entry, value in zip(entries, results, strict=True):
                self._settle(entry, value, failed=False)
        finally:
            elapsed = self._clock() - started
            prev = self._batch_time_s
            self._batch_time_s = elapsed if prev is None else prev + _EWMA_ALPHA * (elapsed - prev)
            self.metrics.service.observe(elapsed)
            self._inflight -= 1
            self._wake.set()

    def _settle(self, entry: _Entry, value: Any, failed: bool) -> None:
        # To the entry's own future, not looked up by ID: a retry that reused the ID after a timeout
        # must not receive the abandoned attempt's result.
        fut = entry.future
        if fut.done():
            self.stats.late_dropped += 1
        elif failed:
            self.stats.failed += 1
            fut.set_exception(value)
        else:
            self.stats.completed += 1
            fut.set_result(value)

    def _abandon(self, entry: _Entry) -> None:
        """The caller gave up: unqueue its item if not yet flushed; any later result is dropped."""
        if self._pending.get(entry.request_id) is entry:
            del self._pending[entry.request_id]
            self.stats.removed_unflushed += 1
        entry.future.cancel()


def _as_results(raw: Any, expected: int) -> Sequence[Any]:
    if raw is None or isinstance(raw, (str, bytes)):
        raise BatchError(f"batch function returned {type(raw).__name__}, not {expected} results")
    results = raw if isinstance(raw, Sequence) else list(raw)
    if len(results) != expected:
        raise BatchError(f"batch function returned {len(results)} results for {expected} items")
    return results


# The name the README's library example imports; the same class.
Batcher = Flusher
