"""Request-ID registry: one future (whole answer) or one queue (stream) per in-flight ID.

The producer side (the engine's output loop, the `Flusher`'s batch task) resolves, fails, pushes to
or closes an entry by request ID; the consumer side (an HTTP handler) awaits the future or reads the
queue. Contracts:

- An ID is *in flight* from `create_future` / `create_stream` until the entry is resolved, failed,
  closed, cancelled or discarded. Registering an in-flight ID again raises `DuplicateRequestId`, so one
  request never runs twice at once; a finished ID may be reused (a client retry).
- Results for unknown, finished or cancelled IDs are dropped silently: every producer method returns
  False instead of raising, because a late result after a timeout or a disconnect is normal.
- Loop-thread only, like the asyncio objects it holds. A worker thread hands results over with
  `loop.call_soon_threadsafe(registry.resolve, ...)`.
- A stream's reader may fall behind its producer. An item pushed with `merge=True` while the
  reader has not yet taken the previous one is merged into it (`absorb`), so the reader takes
  everything queued in one item; one pushed with `hold=True` does not wake the reader, which is
  then woken by a later push without it or by `release_held` (a producer paces how often a
  reader runs, and each wake finds more to take). A reader never waits for an item it could
  take: a hold only spares a wake-up.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from batcher.core.refusals import DuplicateRequestId

__all__ = ["STREAM_END", "STREAM_WAKES_PER_S", "DuplicateRequestId", "RequestRegistry", "Stream",
           "StreamFailure", "iter_stream", "new_request_id"]


def new_request_id() -> str:
    """A fresh, unguessable request ID: 128 random bits from the OS, in hex (what uuid4 draws,
    without building the UUID object on every request)."""
    return "req-" + os.urandom(16).hex()


class _End:
    """The end-of-stream marker put on a stream's queue."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "STREAM_END"


STREAM_END: Any = _End()

# How many times a second a registry wakes its streams' readers in all, at most, while items
# come faster than that: a paced stream is woken at most every `(streams - 1) / this` seconds,
# and takes everything that came meanwhile as one item. A push without `paced` and a stream
# alone are never held. Each wake of an engine stream costs the event loop a task switch, an SSE
# write and the client a read (tens of microseconds together), which at 256 streams of a fast
# device would be most of every step; a reader gets a chunk of tokens instead, at the same rate.
STREAM_WAKES_PER_S = 10_000.0


@dataclass(slots=True, frozen=True)
class StreamFailure:
    """Put on a stream's queue by `fail` / `cancel`: the reader raises `error` when it reaches it."""

    error: BaseException


class Stream:
    """One stream's items, from the producer to its one reader, in order (an asyncio.Queue for a
    single reader, with merging and held wake-ups; see the module's contracts)."""

    __slots__ = ("_items", "_loop", "_waiter", "woken_at")

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self.woken_at = float("-inf")  # when the producer last woke (or would have woken) it

    def put_nowait(self, item: Any) -> None:
        self.put(item)

    def put(self, item: Any, merge: bool = False, hold: bool = False) -> None:
        items = self._items
        if merge and items:
            last = items[-1]
            if last is not STREAM_END and not isinstance(last, StreamFailure):
                last.absorb(item)
                if not hold:
                    self.wake()
                return
        items.append(item)
        if not hold:
            self.wake()

    def wake(self) -> None:
        """Let the reader take what is queued, if it is waiting."""
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def qsize(self) -> int:
        return len(self._items)

    async def get(self) -> Any:
        items = self._items
        while not items:
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        return items.popleft()


async def iter_stream(queue: Stream | asyncio.Queue[Any]) -> AsyncIterator[Any]:
    """Yield a stream's items until `STREAM_END`; raise the error of a `StreamFailure`."""
    while True:
        item = await queue.get()
        if item is STREAM_END:
            return
        if isinstance(item, StreamFailure):
            raise item.error
        yield item


class RequestRegistry:
    """In-flight request IDs, each with a future or a stream queue (never both)."""

    __slots__ = ("_futures", "_held", "_streams", "wakes_per_s")

    def __init__(self, wakes_per_s: float = STREAM_WAKES_PER_S) -> None:
        self.wakes_per_s = wakes_per_s
        self._futures: dict[str, asyncio.Future[Any]] = {}
        self._streams: dict[str, Stream] = {}
        self._held: dict[str, Stream] = {}  # pushed to with `hold`, not woken since

    # -- consumer side ---------------------------------------------------------------------------

    def create_future(self, request_id: str) -> asyncio.Future[Any]:
        """Register `request_id` for one whole answer and return the future that will carry it."""
        self._check_new(request_id)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._futures[request_id] = fut
        return fut

    def create_stream(self, request_id: str) -> Stream:
        """Register `request_id` for a stream of items; read it with `iter_stream`."""
        self._check_new(request_id)
        stream = self._streams[request_id] = Stream()
        return stream

    def cancel(self, request_id: str) -> bool:
        """End the request: its future is cancelled, its stream's reader gets `CancelledError`."""
        fut = self._futures.pop(request_id, None)
        if fut is not None:
            return fut.cancel()
        queue = self._streams.pop(request_id, None)
        if queue is None:
            return False
        self._held.pop(request_id, None)
        queue.put_nowait(StreamFailure(asyncio.CancelledError()))
        return True

    def discard(self, request_id: str, handle: object | None = None) -> bool:
        """Forget `request_id` without touching its future or queue.

        With `handle`, forget it only while it still maps to that future or queue: a caller that gave
        up must not unregister a retry that has since reused the same ID.
        """
        for table in (self._futures, self._streams):
            entry = table.get(request_id)
            if entry is not None and (handle is None or entry is handle):
                del table[request_id]
                if self._held.get(request_id) is entry:
                    del self._held[request_id]
                return True
        return False

    # -- producer side ---------------------------------------------------------------------------

    def resolve(self, request_id: str, value: Any) -> bool:
        """Deliver the whole answer; False (dropped) if the ID is unknown or its caller gave up."""
        fut = self._futures.pop(request_id, None)
        if fut is None or fut.done():
            return False
        fut.set_result(value)
        return True

    def fail(self, request_id: str, exc: BaseException) -> bool:
        """Fail the request with `exc` (future or stream); False if the ID is unknown."""
        fut = self._futures.pop(request_id, None)
        if fut is not None:
            if fut.done():
                return False
            fut.set_exception(exc)
            return True
        queue = self._streams.pop(request_id, None)
        if queue is None:
            return False
        self._held.pop(request_id, None)
        queue.put_nowait(StreamFailure(exc))
        return True

    def push(self, request_id: str, item: Any, *, merge: bool = False, paced: bool = False,
             now: float = 0.0) -> bool:
        """Append `item` to the request's stream; False if the ID is not an open stream.
        `merge`: into the item its reader has not taken yet, if any. `paced`: a stream woken
        less than `hold_seconds()` before `now` is held, not woken (see the module's
        contracts); a wake notes `now` as the stream's `woken_at`."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        hold = paced and now - stream.woken_at < (len(self._streams) - 1) / self.wakes_per_s
        stream.put(item, merge, hold)
        if hold:
            self._held[request_id] = stream
        else:
            stream.woken_at = now
            if self._held:
                self._held.pop(request_id, None)
        return True

    def hold_seconds(self) -> float:
        """How long after a wake a paced push holds a stream: every stream's share of
        `wakes_per_s`."""
        return (len(self._streams) - 1) / self.wakes_per_s

    def release_held(self, now: float) -> int:
        """Wake every held stream last woken `hold_seconds()` or more before `now`; how many."""
        if not self._held:
            return 0
        interval = self.hold_seconds()
        due = [rid for rid, s in self._held.items() if now - s.woken_at >= interval]
        for rid in due:
            stream = self._held.pop(rid)
            stream.woken_at = now
            stream.wake()
        return len(due)

    def close_stream(self, request_id: str) -> bool:
        """End the request's stream normally; False if the ID is not an open stream."""
        queue = self._streams.pop(request_id, None)
        if queue is None:
            return False
        self._held.pop(request_id, None)
        queue.put_nowait(STREAM_END)
        return True

    # -- inspection ------------------------------------------------------------------------------

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._futures or request_id in self._streams

    def __len__(self) -> int:
        return len(self._futures) + len(self._streams)

    def _check_new(self, request_id: str) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self._futures or request_id in self._streams:
            raise DuplicateRequestId(f"request id {request_id!r} is already in flight")
