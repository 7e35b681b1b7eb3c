"""Token buckets per source address, bounded in memory (a flood from many addresses cannot grow
the table without limit)."""

from __future__ import annotations

from collections import OrderedDict


class SourceLimiter:
    """`rate` events per second per source, bursts up to `burst`. Pure: the caller passes `now`."""

    __slots__ = ("_buckets", "burst", "max_sources", "rate")

    def __init__(self, rate: float, burst: int, max_sources: int = 4096):
        self.rate = rate
        self.burst = burst
        self.max_sources = max_sources
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def allow(self, source: str, now: float) -> bool:
        tokens, at = self._buckets.pop(source, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        ok = tokens >= 1.0
        self._buckets[source] = (tokens - 1.0 if ok else tokens, now)
        if len(self._buckets) > self.max_sources:
            self._buckets.popitem(last=False)  # the least recently seen source starts afresh
        return ok

    def retry_after(self) -> float:
        return 1.0 / self.rate
