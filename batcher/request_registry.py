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
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from batcher.core.refusals import DuplicateRequestId

__all__ = ["STREAM_END", "DuplicateRequestId", "RequestRegistry", "StreamFailure", "iter_stream",
           "new_request_id"]


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


@dataclass(slots=True, frozen=True)
class StreamFailure:
    """Put on a stream's queue by `fail` / `cancel`: the reader raises `error` when it reaches it."""

    error: BaseException


async def iter_stream(queue: asyncio.Queue[Any]) -> AsyncIterator[Any]:
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

    __slots__ = ("_futures", "_streams")

    def __init__(self) -> None:
        self._futures: dict[str, asyncio.Future[Any]] = {}
        self._streams: dict[str, asyncio.Queue[Any]] = {}

    # -- consumer side ---------------------------------------------------------------------------

    def create_future(self, request_id: str) -> asyncio.Future[Any]:
        """Register `request_id` for one whole answer and return the future that will carry it."""
        self._check_new(request_id)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._futures[request_id] = fut
        return fut

    def create_stream(self, request_id: str, maxsize: int = 0) -> asyncio.Queue[Any]:
        """Register `request_id` for a stream of items; read it with `iter_stream`."""
        self._check_new(request_id)
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize)
        self._streams[request_id] = queue
        return queue

    def cancel(self, request_id: str) -> bool:
        """End the request: its future is cancelled, its stream's reader gets `CancelledError`."""
        fut = self._futures.pop(request_id, None)
        if fut is not None:
            return fut.cancel()
        queue = self._streams.pop(request_id, None)
        if queue is None:
            return False
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
        queue.put_nowait(StreamFailure(exc))
        return True

    def push(self, request_id: str, item: Any) -> bool:
        """Append `item` to the request's stream; False if the ID is not an open stream.

        Raises `asyncio.QueueFull` only for a stream created with a `maxsize` that its reader lets fill.
        """
        queue = self._streams.get(request_id)
        if queue is None:
            return False
        queue.put_nowait(item)
        return True

    def close_stream(self, request_id: str) -> bool:
        """End the request's stream normally; False if the ID is not an open stream."""
        queue = self._streams.pop(request_id, None)
        if queue is None:
            return False
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
