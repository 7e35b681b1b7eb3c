"""`POST /v1/probe` is an operator's tool, not a tenant's: the one-token deep probe runs ahead of
every client, so it needs the replica's admin or fleet key, is rate-limited, and concurrent probes
share one engine request (so probes hold at most one place in the queue, however many callers).

Contract: `ProbeGuard.check(headers)` raises `ApiError` 401 (no matching key; a replica with
neither key configured refuses every probe) or 429 (over `rate` per second, bursts of `burst`);
`await ProbeGuard.run(probe)` awaits the probe in flight or starts one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping

from batcher.http.errors import ApiError
from batcher.http.keys import Headers, bearer_matches


class ProbeGuard:
    __slots__ = ("_at", "_flight", "_tokens", "burst", "clock", "keys", "rate")

    def __init__(self, keys: tuple[str | None, ...], rate: float = 10.0, burst: int = 10,
                 clock: Callable[[], float] = time.monotonic):
        self.keys = tuple(k for k in keys if k)
        self.rate, self.burst, self.clock = rate, burst, clock
        self._tokens, self._at = float(burst), clock()
        self._flight: asyncio.Future[float] | None = None

    def holds_key(self, headers: Headers | Mapping[str, str]) -> bool:
        """The caller's bearer key is the admin or the fleet key."""
        # Every key is compared, so the time taken does not say which one matched.
        return sum(bearer_matches(headers, k) for k in self.keys) > 0

    def check(self, headers: Headers | Mapping[str, str]) -> None:
        if not self.holds_key(headers):
            raise ApiError(401, "the probe needs this replica's admin or fleet key",
                           code="invalid_api_key")
        now = self.clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens < 1.0:
            raise ApiError(429, "too many probes", code="rate_limited", retry_after=1)
        self._tokens -= 1.0

    async def run(self, probe: Callable[[], Awaitable[float]], timeout: float) -> float:
        """The latency of the probe in flight, or of a new one; TimeoutError after `timeout`
        seconds for this caller. One caller leaving never cancels the probe others wait for."""
        if self._flight is None or self._flight.done():
            self._flight = asyncio.ensure_future(probe())
            # A failed probe nobody awaits any more must not log "exception never retrieved".
            self._flight.add_done_callback(lambda f: f.cancelled() or f.exception())
        async with asyncio.timeout(timeout):
            return await asyncio.shield(self._flight)
