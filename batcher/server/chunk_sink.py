"""What a stream writes for each chat or completion chunk and at its end: the plain SSE events,
or what a route translating another API onto chat completions sends instead."""

from __future__ import annotations

from typing import Any, Protocol

from batcher.http.sse import DONE, sse_event


class ChunkSink(Protocol):
    """The bytes a stream sends for each chat chunk (an error body included) and at its end.
    `end` may await (a route storing what the stream produced before its final event)."""

    def chunk(self, payload: dict[str, Any]) -> bytes: ...

    async def end(self) -> bytes: ...


class _SseChunks:
    """Chat and completion chunks as they are: one `data:` event each, then `[DONE]`."""

    def chunk(self, payload: dict[str, Any]) -> bytes:
        return sse_event(payload)

    async def end(self) -> bytes:
        return DONE


SSE_CHUNKS = _SseChunks()
