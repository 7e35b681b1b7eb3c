"""The router's share of a request's latency: its `route` phase (choosing a replica, connecting,
retries, relaying) added in front of the replica's own phases, on whole answers (body and
`Server-Timing`) and on a stream's usage chunk. The router's clock starts when its handler
does; the replica's phases are forwarded unchanged. A stream that ends before its usage chunk
(its client left, or it broke) has only what the router saw: `RelayedTimings`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from batcher.telemetry.timings import Timings

_MARK = b'"timings"'
_LAST = b',"timings":{'


@dataclass(slots=True)
class RelayedTimings(Timings):
    """The access line's timings of a stream that ended before the replica's usage chunk: the
    router's total and the completion tokens it relayed (`StreamLedger.generated`). The
    replica's phases never reached the router (the replica's own line for the same request id
    has them), so none is written, and no bottleneck is blamed."""

    def to_json(self) -> dict[str, Any]:
        return {"total_ms": round(self.total_ms, 3), "completion_tokens": self.completion_tokens}


class RouteClock:
    """`observe` gets each answer's timings as relayed (the router's phase histograms)."""

    __slots__ = ("clock", "observe", "received", "timings")

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 observe: Callable[[Timings], None] | None = None) -> None:
        self.clock = clock
        self.received = clock()
        self.observe = observe
        self.timings: Timings | None = None  # the last relayed, for the access line

    def _routed(self, t: Timings) -> Timings:
        routed = t.through_router(self.elapsed_ms())
        self.timings = routed
        if self.observe is not None:
            self.observe(routed)
        return routed

    def elapsed_ms(self) -> float:
        return (self.clock() - self.received) * 1000.0

    def whole(self, data: bytes, headers: dict[str, str]) -> bytes:
        """A whole answer's body with `route` added to its timings (and the `Server-Timing`
        header set in `headers`); an answer without timings is passed on unchanged."""
        if _MARK not in data:
            return data
        # A replica writes `timings` as the body's last key: then only that object is read and
        # rewritten. (The marker cannot occur inside a JSON string, whose quotes are escaped;
        # one nested deeper leaves closing braces after it, and the slice is not one object.)
        i = data.rfind(_LAST)
        if i > 0 and data.endswith(b"}"):
            try:
                t = Timings.from_json(orjson.loads(data[i + len(_LAST) - 1:-1]))
            except orjson.JSONDecodeError:
                t = None
            if t is not None:
                timings = orjson.dumps(self._routed_whole(t, headers))
                return b"".join((data[:i], b',"timings":', timings, b"}"))
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return data
        t = Timings.from_json(obj.get("timings")) if isinstance(obj, dict) else None
        if t is None:
            return data
        obj["timings"] = self._routed_whole(t, headers)
        return orjson.dumps(obj)

    def _routed_whole(self, t: Timings, headers: dict[str, str]) -> dict[str, object]:
        """A whole answer's `timings` with `route` added, its `Server-Timing` set in `headers`."""
        routed = self._routed(t)
        headers["Server-Timing"] = routed.server_timing()
        return routed.to_json()

    def stream(self, data: bytes) -> bytes:
        """SSE bytes on their way to the client, with `route` added to a usage chunk's timings.
        Only chunks that carry timings are parsed; every other byte passes untouched."""
        if _MARK not in data:
            return data
        events = data.split(b"\n\n")
        for i, ev in enumerate(events):
            if _MARK not in ev or not ev.startswith(b"data: {"):
                continue
            try:
                obj = orjson.loads(ev[6:])
            except orjson.JSONDecodeError:
                continue
            t = Timings.from_json(obj.get("timings")) if isinstance(obj, dict) else None
            if t is not None:
                obj["timings"] = self._routed(t).to_json()
                events[i] = b"data: " + orjson.dumps(obj)
        return b"\n\n".join(events)
