"""A tenant that just did something costly to everyone is refused that kind of request for a
while (429 + Retry-After), and served as usual otherwise. One bounded map on the event loop, no
locks; each use names its own error code and message (`grammar_cooldown`, `oversize_cooldown`,
`malformed_cooldown`).

A refusal of a tenant that did not wait out its cool-down is held a second before it is sent
(`batcher.http.held_answers`): a client looping on refusals then sends one request a second per
connection instead of thousands, and the other tenants keep the event loop and the CPUs.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from batcher.http.errors import ApiError

# Tenants remembered at most (oldest forgotten first): tenants are configured, so this is a bound
# against a bug, not a limit anyone reaches.
MAX_TENANTS = 10_000
# How long a refusal for a cool-down is held before it is sent (see the module's docstring).
HOLD_S = 1.0


class TenantCooldown:
    """`note(tenant)` starts `tenant`'s cool-down of `cooldown_s`; `check(tenant)` raises the
    429 while it lasts, held `hold_s` before it is sent. `close`: the refusal also closes the
    connection, for a request refused before its body is read (aiohttp would otherwise read the
    unread body to keep the connection, which is the very cost being refused)."""

    def __init__(self, cooldown_s: float, code: str, message: str, param: str | None = None,
                 close: bool = False, clock: Callable[[], float] = time.monotonic,
                 hold_s: float = HOLD_S, threshold: int = 1, window_s: float = 0.0) -> None:
        self.cooldown_s, self.code, self.message, self.param = cooldown_s, code, message, param
        self.close, self.clock, self.hold_s = close, clock, hold_s
        self.threshold, self.window_s = threshold, window_s
        self._since: OrderedDict[str, float] = OrderedDict()
        # With a threshold above one: each tenant's latest acts, at most `threshold` of them.
        self._acts: OrderedDict[str, deque[float]] = OrderedDict()

    def note(self, tenant: str) -> None:
        """One costly act of `tenant`'s: the `threshold`-th within `window_s` (with the default
        threshold, the first) starts its cool-down."""
        now = self.clock()
        if self.threshold > 1:
            acts = self._acts.get(tenant)
            if acts is None:
                acts = self._acts[tenant] = deque(maxlen=self.threshold)
            self._acts.move_to_end(tenant)
            _forget_oldest(self._acts)
            acts.append(now)
            if len(acts) < self.threshold or now - acts[0] > self.window_s:
                return
            acts.clear()
        self._since[tenant] = now
        self._since.move_to_end(tenant)
        _forget_oldest(self._since)

    def check(self, tenant: str) -> None:
        at = self._since.get(tenant)
        if at is None:
            return
        left = at + self.cooldown_s - self.clock()
        if left <= 0:
            del self._since[tenant]
            return
        raise ApiError(429, self.message.format(seconds=f"{self.cooldown_s:g}"), param=self.param,
                       code=self.code, retry_after=max(1, math.ceil(left)),
                       headers={"Connection": "close"} if self.close else None,
                       hold_s=self.hold_s)


def _forget_oldest(table: OrderedDict) -> None:
    while len(table) > MAX_TENANTS:
        table.popitem(last=False)
