"""A token bucket: `capacity` tokens refilled continuously at `rate_per_s` (admission's
per-tenant token budgets, the router's per-source heartbeat limit)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

# Refill round-off: waiting exactly the returned time must always succeed.
_TAKE_TOLERANCE = 1e-9


class TokenBucket:
    """Holds up to `capacity` tokens, refilled continuously at `rate_per_s`; starts full.

    Time comes from `clock`, or from `now` where a caller passes it (a pure caller that keeps
    its own time passes `now` everywhere, the constructor included)."""

    __slots__ = ("_clock", "_last", "_tokens", "capacity", "rate_per_s")

    def __init__(
        self, rate_per_s: float, capacity: float, clock: Callable[[], float] = time.monotonic,
        *, now: float | None = None,
    ) -> None:
        if not (rate_per_s > 0 and math.isfinite(rate_per_s)) or not capacity > 0:
            raise ValueError(f"bucket needs rate and capacity > 0, got {rate_per_s}, {capacity}")
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self._clock = clock
        self._tokens = float(capacity)
        self._last = clock() if now is None else now

    def _refill(self, now: float | None) -> None:
        if now is None:
            now = self._clock()
        # max(): a clock that steps back must not drain the bucket.
        elapsed = max(0.0, now - self._last)
        self._last = now
        self._tokens = min(self.capacity, self._tokens + elapsed * self.rate_per_s)

    @property
    def tokens(self) -> float:
        """Tokens available now."""
        self._refill(None)
        return self._tokens

    def wait_time(self, n: float, now: float | None = None) -> float:
        """Seconds until `n` tokens are available (0 if now; inf if `n` exceeds capacity). Takes
        nothing."""
        if n > self.capacity:
            return math.inf
        self._refill(now)
        deficit = n - self._tokens
        if deficit <= _TAKE_TOLERANCE * max(1.0, n):
            return 0.0
        return deficit / self.rate_per_s

    def try_take(self, n: float, now: float | None = None) -> float:
        """Take `n` tokens and return 0, or take nothing and return `wait_time(n)`."""
        wait = self.wait_time(n, now)
        if wait == 0.0:
            self._tokens -= n
        return wait

    def refund(self, n: float) -> None:
        """Give back `n` tokens, never filling past capacity."""
        self._refill(None)
        self._tokens = min(self.capacity, self._tokens + max(0.0, n))
