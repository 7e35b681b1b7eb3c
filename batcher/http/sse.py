"""Server-sent events framing: one `data:` line per JSON event, a blank line after each."""

from __future__ import annotations

from typing import Any

import orjson

SEP = b"\n\n"
DONE = b"data: [DONE]" + SEP
# A proxy in between must neither buffer nor cache the stream.
SSE_HEADERS: dict[str, str] = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                               "X-Accel-Buffering": "no"}


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + SEP


def sse_named(event: str, payload: dict[str, Any]) -> bytes:
    """A named event (`event:` then `data:`), as the Responses and Anthropic streams send."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(payload) + SEP
