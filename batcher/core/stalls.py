"""Stalls: spans in which the engine was held up by something other than the work it was given.

A kernel compiled on first use, a garbage-collector pause or an event loop blocked by a handler
delays every request waiting at the time, by the same amount, whatever admission decided. Such a
delay says nothing about how much work the server can take: the SLO controller and the TTFT
correction must not learn from it (they would refuse traffic the device could serve, for as long
as the stall stays in their windows). The engine notes each stall here; admission subtracts the
stalled time that overlapped a request's wait before judging its first token.

A stall is told apart from a slower machine by being sudden and short-lived: a step far over its
prediction, or a gap between steps while work was pending. Once steps stay that slow, they are the
machine's new speed, not a stall (`StallDetector`). Pure Python, on the caller's clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# A step this many times over its predicted time, by at least STALL_MIN_S, is a stall...
STALL_FACTOR = 3.0
STALL_MIN_S = 0.05
# ...unless this many steps in a row were: then the machine itself is slower.
STALL_RUN = 3
# Stalls are kept this long (longer than any TTFT SLO worth having).
KEEP_S = 120.0
KEEP_MAX = 1024


@dataclass(slots=True)
class StallLog:
    """Recent stall spans `(start, end)`, oldest first."""

    spans: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=KEEP_MAX))
    count: int = 0

    def note(self, start: float, end: float) -> None:
        if not end > start:
            return
        self.spans.append((start, end))
        self.count += 1
        while self.spans and self.spans[0][1] < end - KEEP_S:
            self.spans.popleft()

    def overlap(self, start: float, end: float) -> float:
        """Seconds of stall within `[start, end]`."""
        got = 0.0
        for a, b in reversed(self.spans):
            if b <= start:
                break
            got += max(0.0, min(b, end) - max(a, start))
        return got


@dataclass(slots=True)
class StallDetector:
    """Reads each step (its measured and predicted model time, and the gap before it) and notes
    the stalls into `log`."""

    log: StallLog = field(default_factory=StallLog)
    _run: int = 0

    def step(self, started: float, seconds: float, predicted_s: float, gap_s: float) -> bool:
        """A step began at `started` after `gap_s` of loop time with work pending, and took
        `seconds` where `predicted_s` was predicted. True when the step itself stalled."""
        if gap_s > STALL_MIN_S:
            self.log.note(started - gap_s, started)
        extra = seconds - predicted_s
        if predicted_s > 0 and seconds > STALL_FACTOR * predicted_s and extra > STALL_MIN_S:
            self._run += 1
            if self._run < STALL_RUN:
                self.log.note(started + predicted_s, started + seconds)
                return True
            return False
        self._run = 0
        return False
