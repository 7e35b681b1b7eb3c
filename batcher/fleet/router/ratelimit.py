"""Token buckets per source address, and the retry budget per caller, bounded in memory (a
flood from many addresses or keys cannot grow the tables without limit)."""

from __future__ import annotations

from collections import OrderedDict

from batcher.fleet.router.retry_budget import RetryBudget
from batcher.admission.token_bucket import TokenBucket


class SourceLimiter:
    """`rate` events per second per source, bursts up to `burst`: one `TokenBucket` per source.
    Pure: the caller passes `now`."""

    __slots__ = ("_buckets", "burst", "max_sources", "rate")

    def __init__(self, rate: float, burst: int, max_sources: int = 4096):
        self.rate = rate
        self.burst = burst
        self.max_sources = max_sources
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def allow(self, source: str, now: float) -> bool:
        bucket = self._buckets.pop(source, None)
        if bucket is None:
            bucket = TokenBucket(self.rate, self.burst, now=now)
        self._buckets[source] = bucket
        if len(self._buckets) > self.max_sources:
            self._buckets.popitem(last=False)  # the least recently seen source starts afresh
        return bucket.try_take(1.0, now) == 0.0

    def retry_after(self) -> float:
        return 1.0 / self.rate


class KeyedRetryBudget:
    """The retry budget kept per caller (the router's credential scope): each caller may retry
    `max(floor, ratio x its own requests in the window)` times per window, so one caller whose
    requests keep failing cannot spend the failover every other caller relies on. Bounded in
    memory as `SourceLimiter` is: the least recently seen caller starts afresh."""

    __slots__ = ("_budgets", "floor", "max_keys", "ratio", "window")

    def __init__(self, ratio: float = 0.1, floor: int = 3, window: float = 10.0,
                 max_keys: int = 4096):
        RetryBudget(ratio, floor, window)  # validates
        self.ratio, self.floor, self.window, self.max_keys = ratio, floor, window, max_keys
        self._budgets: OrderedDict[str, RetryBudget] = OrderedDict()

    def _of(self, key: str) -> RetryBudget:
        budget = self._budgets.pop(key, None)
        if budget is None:
            budget = RetryBudget(self.ratio, self.floor, self.window)
        self._budgets[key] = budget
        if len(self._budgets) > self.max_keys:
            self._budgets.popitem(last=False)
        return budget

    def note_request(self, now: float, key: str = "") -> None:
        self._of(key).note_request(now)

    def try_spend(self, now: float, key: str = "") -> bool:
        return self._of(key).try_spend(now)

    def allowed(self, now: float, key: str = "") -> float:
        """Retries `key` may make in the current window."""
        budget = self._budgets.get(key)
        return float(self.floor) if budget is None else budget.allowed(now)

    def retries_in_window(self, now: float) -> int:
        """Retries of all callers in the current window."""
        total = 0
        for budget in self._budgets.values():
            budget.allowed(now)  # prunes
            total += budget.retries_in_window
        return total

    def __len__(self) -> int:
        return len(self._budgets)
