"""The share of the TTFT SLO admission admits up to, moved by the TTFTs admitted requests get.

The TTFT prediction is centred (`TtftPredictor.correction` is about the median of delivered over
predicted), so admitting every request predicted within the whole SLO would let about half of
those at the limit miss it. How far below the SLO to stop depends on how much delivered TTFTs
scatter around their predictions, which no constant fits: a quiet machine scatters little, a
shared one a lot. This controller finds it from the goal itself:

- a miss cuts the share by `CUT`, at most once per round (a request admitted before the last cut
  was admitted under the old share and tells nothing about the new one). A miss is a first token
  later than `MISS_AT` of the SLO, or a request still waiting that is already on course to be one
  (`behind`): seen while it waits, a slowdown is acted on before every request admitted behind
  it has reached its first token;
- time without a miss raises the share: quickly (`FAST_PER_S`) back up to just under the share
  the last miss came at, then slowly (`SLOW_PER_S`) past it, so the share settles just under the
  level where misses begin, and a transient slowdown (a cut to the floor) is recovered within a
  few seconds once it ends.

The share stays within [`FLOOR`, `CEILING`]: a prediction that is right but scattered must still
admit enough to keep the server busy. Pure arithmetic on the caller's clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

# A first token later than this share of the SLO counts as a miss: the server's own clock stops
# before the client's (the answer still has to reach it), so the controller acts a little early.
MISS_AT = 0.9
CUT = 0.75
# A request still waiting this many times its prediction counts as a miss (see `behind`).
LATE_BY = 1.5
# Share gained per second without a miss: below PROBE_AT x the share of the last miss, and past it.
FAST_PER_S = 0.1
SLOW_PER_S = 0.01
PROBE_AT = 0.9
CEILING = 0.85
FLOOR = 0.3


class Watched(Protocol):
    """An admitted request as the controller watches it (admission's `Ticket`)."""

    admitted_at: float
    predicted_corrected_s: float
    first_token_seen: bool
    released: bool


@dataclass(slots=True)
class SloLimit:
    """`share`: interactive requests are admitted while predicted within `share` x the SLO.
    Feed it every admitted request's first token (`observe`)."""

    share: float = CEILING
    cuts: int = 0
    _cut_at: float = float("-inf")
    _missed_at_share: float = float("inf")
    _last: float | None = None
    # Requests held to the limit still waiting for their first token, oldest first.
    _waiting: deque[Watched] = field(default_factory=deque, repr=False)

    def observe(self, now: float, admitted_at: float, ttft_s: float, slo_s: float) -> None:
        """A request admitted at `admitted_at` got its first token `ttft_s` later (at `now`)."""
        if not (ttft_s >= 0 and slo_s > 0):
            return
        if ttft_s > MISS_AT * slo_s:
            self.missed(now, admitted_at)
        else:
            self.raise_to(now)

    def raise_to(self, now: float) -> None:
        """No miss seen up to `now`: raise the share for the time since the last update."""
        dt = 0.0 if self._last is None else min(1.0, max(0.0, now - self._last))
        self._last = now
        per_s = FAST_PER_S if self.share < PROBE_AT * self._missed_at_share else SLOW_PER_S
        self.share = min(CEILING, self.share + per_s * dt)

    def missed(self, now: float, admitted_at: float) -> None:
        """A request admitted at `admitted_at` missed, or is known now to be missing."""
        if admitted_at >= self._cut_at:
            self._missed_at_share = self.share
            self.share = max(FLOOR, self.share * CUT)
            self._cut_at = now
            self._last = now
            self.cuts += 1

    def counts(self, admitted_at: float) -> bool:
        """Whether a miss of a request admitted at `admitted_at` would cut the share now."""
        return admitted_at >= self._cut_at

    @staticmethod
    def behind(elapsed_s: float, predicted_s: float, slo_s: float) -> bool:
        """A request still waiting `elapsed_s` after admission, predicted (corrected) at
        `predicted_s`, is on course to miss: it is already late by `MISS_AT` of the SLO, or
        `LATE_BY` times its prediction (a slowdown that the requests admitted behind it, nearer
        the limit, will not survive), and at least half the SLO has gone (a short prediction's
        scatter tells little)."""
        return elapsed_s > max(0.5 * slo_s, min(MISS_AT * slo_s, LATE_BY * predicted_s))

    def watch(self, request: Watched) -> None:
        """Watch an admitted request until its first token (see `check_waiting`)."""
        self._waiting.append(request)

    def check_waiting(self, now: float, slo_s: float,
                      stalled: Callable[[float, float], float] | None = None) -> None:
        """Cut the share as soon as a request admitted since the last cut is on course to miss
        (`behind`), without waiting for its first token: by then every request admitted in the
        meantime would have been admitted under the share that failed it. `stalled(a, b)`:
        seconds of engine stall within [a, b], not counted as waiting."""
        queue = self._waiting
        while queue and (queue[0].first_token_seen or queue[0].released):
            queue.popleft()
        for r in queue:  # bounded by the requests admitted within about one SLO
            if r.first_token_seen or r.released or not self.counts(r.admitted_at):
                continue
            # The oldest one that counts is the one furthest behind.
            elapsed = now - r.admitted_at
            if stalled is not None:
                elapsed -= stalled(r.admitted_at, now)
            if self.behind(elapsed, r.predicted_corrected_s, slo_s):
                self.missed(now, r.admitted_at)
            return
