"""When the router may retry, and how long it waits first.

- `RetryBudget`: retries <= max(floor, ratio * requests seen in the window, or in flight).
- `backoff(...)`: full jitter.
"""

from __future__ import annotations

from collections import deque


class RetryBudget:
    """Fleet-wide: a retry is allowed while retries in the window stay within
    `max(floor, ratio * max(requests in the window, requests in flight))`."""

    def __init__(self, ratio: float = 0.1, floor: int = 3, window: float = 10.0):
        if ratio < 0 or floor < 0 or window <= 0:
            raise ValueError("retry budget: ratio, floor >= 0 and window > 0")
        self.ratio, self.floor, self.window = ratio, floor, window
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()

    def _prune(self, now: float) -> None:
        cut = now - self.window
        for q in (self._requests, self._retries):
            while q and q[0] < cut:
                q.popleft()

    def note_request(self, now: float) -> None:
        self._requests.append(now)

    def allowed(self, now: float, inflight: int = 0) -> float:
        self._prune(now)
        return max(float(self.floor), self.ratio * max(len(self._requests), inflight))

    def try_spend(self, now: float, inflight: int = 0) -> bool:
        if len(self._retries) + 1 > self.allowed(now, inflight):
            return False
        self._retries.append(now)
        return True

    @property
    def retries_in_window(self) -> int:
        return len(self._retries)


def backoff(retry: int, base: float, cap: float, r: float) -> float:
    """Full jitter: uniform in [0, min(cap, base * 2**retry)) given `r` uniform in [0, 1)."""
    return r * min(cap, base * (2 ** max(0, retry)))
