"""Admission control: per-tenant token buckets, concurrency caps and a bounded, SLO-aware queue.

Each request is charged `prompt_tokens + max_tokens` from its tenant's bucket when admitted and
refunded what it did not generate on `release`. `admit` checks, in this order:

1. draining                       -> 503 `draining`
2. priority not allowed           -> ValueError (400)
3. cost > the tenant's burst      -> ValueError (400: it could never be admitted)
4. tenant at `max_concurrent`     -> 429 `tenant_concurrency`
5. bucket short of `cost` tokens  -> 429 `tenant_tokens`, retry_after exact from the refill rate
6. queue at its bound             -> 503 `queue_full`; interactive may fill `max_waiting`, batch
                                     only `batch_share` of it, so batch is shed first
7. estimated wait over the SLO    -> 503 `queue_slo`; wait = waiting_tokens / measured prefill
                                     rate; batch is refused above 1x the TTFT SLO, interactive
                                     above 2x (it is served before batch, so the estimate
                                     over-states its wait); no check until a rate is measured

A 503's retry_after is the estimated time (at the measured prefill rate, at least 1 s) for the queue
to drain far enough that the check would pass: the whole queue when draining, the excess over the
bound when full, the excess wait over the SLO limit. A concurrency 429 waits one mean service time
(1 s until measured). Budget is charged only on admission: a 429 or 503 never costs tokens.

All state lives on the event loop (no locks); `clock` is injectable so tests drive time by hand.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from batcher.core.refusals import Refused
from batcher.tenants import PRIORITIES, TenantConfig

REASONS = ("tenant_tokens", "tenant_concurrency", "queue_full", "queue_slo", "draining")
# A 503 tells the client to come back no sooner than this: sooner would only add load.
_MIN_503_RETRY_S = 1.0
# Used for a 429 on concurrency until a service time has been measured.
_DEFAULT_SERVICE_S = 1.0
# Refill round-off: waiting exactly the returned time must always succeed.
_TAKE_TOLERANCE = 1e-9
_EWMA_ALPHA = 0.2
_INTERACTIVE_SLO_FACTOR = 2.0


class Rejected(Exception):
    """Refused for now: `status` 429 (the tenant's budget) or 503 (the server's queue or drain);
    `retry_after` (seconds, > 0) says when a retry can expect to succeed; `reason` is in REASONS."""

    def __init__(self, status: int, retry_after: float, reason: str, message: str) -> None:
        assert status in (429, 503) and retry_after > 0 and reason in REASONS
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.reason = reason
        self.message = message

    @property
    def retry_after_header(self) -> str:
        """`Retry-After` takes whole seconds: round up, so an honoured header is never early."""
        return str(max(1, math.ceil(self.retry_after)))


class TokenBucket:
    """Holds up to `capacity` tokens, refilled continuously at `rate_per_s`; starts full."""

    __slots__ = ("_clock", "_last", "_tokens", "capacity", "rate_per_s")

    def __init__(
        self, rate_per_s: float, capacity: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not (rate_per_s > 0 and math.isfinite(rate_per_s)) or not capacity > 0:
            raise ValueError(f"bucket needs rate and capacity > 0, got {rate_per_s}, {capacity}")
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self._clock = clock
        self._tokens = float(capacity)
        self._last = clock()

    def _refill(self) -> None:
        now = self._clock()
        # max(): a clock that steps back must not drain the bucket.
        elapsed = max(0.0, now - self._last)
        self._last = now
        self._tokens = min(self.capacity, self._tokens + elapsed * self.rate_per_s)

    @property
    def tokens(self) -> float:
        """Tokens available now."""
        self._refill()
        return self._tokens

    def wait_time(self, n: float) -> float:
        """Seconds until `n` tokens are available (0 if now; inf if `n` exceeds capacity). Takes
        nothing."""
        if n > self.capacity:
            return math.inf
        self._refill()
        deficit = n - self._tokens
        if deficit <= _TAKE_TOLERANCE * max(1.0, n):
            return 0.0
        return deficit / self.rate_per_s

    def try_take(self, n: float) -> float:
        """Take `n` tokens and return 0, or take nothing and return `wait_time(n)`."""
        wait = self.wait_time(n)
        if wait == 0.0:
            self._tokens -= n
        return wait

    def refund(self, n: float) -> None:
        """Give back `n` tokens, never filling past capacity."""
        self._refill()
        self._tokens = min(self.capacity, self._tokens + max(0.0, n))


@dataclass(slots=True)
class Ticket:
    """One admitted request; hand it back to `Admission.release` exactly when it ends."""

    tenant: str
    cost: int
    max_tokens: int
    priority: str = "interactive"
    released: bool = False


@dataclass(slots=True)
class _TenantState:
    bucket: TokenBucket | None  # None: unlimited tenant
    in_flight: int = 0


@dataclass(slots=True)
class _Ewma:
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + _EWMA_ALPHA * (x - self.value)


@dataclass(slots=True)
class Admission:
    """Decides, per request, admit or refuse (see the module docstring for the order of checks).

    `tenants=None` (or empty) means auth is off; the lone default tenant is unlimited, but the queue
    and drain checks still protect the server. `batch_share`: the fraction of `max_waiting` that
    batch requests may fill.
    """

    tenants: dict[str, TenantConfig] | None
    max_waiting: int = 256
    slo_ttft_s: float | None = None
    clock: Callable[[], float] = time.monotonic
    batch_share: float = 0.5
    draining: bool = field(default=False, init=False)
    # Rejections by reason, for the `requests_rejected{reason}` metric.
    rejections: dict[str, int] = field(init=False)
    _state: dict[str, _TenantState] = field(default_factory=dict, init=False, repr=False)
    # Prefill rate = EWMA(tokens) / EWMA(seconds): weighted by work, so one tiny prefill cannot
    # swing the estimate the way an average of per-sample rates would.
    _prefill_tokens: _Ewma = field(default_factory=_Ewma, init=False, repr=False)
    _prefill_seconds: _Ewma = field(default_factory=_Ewma, init=False, repr=False)
    _service_s: _Ewma = field(default_factory=_Ewma, init=False, repr=False)

    def __post_init__(self) -> None:
        self.rejections = dict.fromkeys(REASONS, 0)
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.slo_ttft_s is not None and not self.slo_ttft_s > 0:
            raise ValueError(f"slo_ttft_s must be > 0, got {self.slo_ttft_s}")
        if not 0 < self.batch_share <= 1:
            raise ValueError(f"batch_share must be in (0, 1], got {self.batch_share}")

    # -- measurements -------------------------------------------------------------------------

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Feed one measured prefill (`tokens` computed in `seconds`); empty samples are ignored."""
        if tokens > 0 and seconds > 0:
            self._prefill_tokens.add(float(tokens))
            self._prefill_seconds.add(seconds)

    def observe_service(self, seconds: float) -> None:
        """Feed one finished request's service time (admission to last token)."""
        if seconds > 0:
            self._service_s.add(seconds)

    @property
    def prefill_rate(self) -> float | None:
        """Measured prefill tokens per second, or None before the first measurement."""
        t, s = self._prefill_tokens.value, self._prefill_seconds.value
        return None if t is None or s is None else t / s

    @property
    def service_time_s(self) -> float | None:
        """Mean service time (EWMA), or None before the first measurement."""
        return self._service_s.value

    def set_draining(self, draining: bool) -> None:
        self.draining = draining

    def in_flight(self, tenant: str) -> int:
        st = self._state.get(tenant)
        return 0 if st is None else st.in_flight

    # -- decisions ----------------------------------------------------------------------------

    def _tenant_state(self, tenant: TenantConfig) -> _TenantState:
        st = self._state.get(tenant.name)
        if st is None:
            bucket = None
            if not tenant.unlimited:
                bucket = TokenBucket(tenant.tokens_per_minute / 60.0, tenant.burst, self.clock)
            st = self._state[tenant.name] = _TenantState(bucket)
        return st

    def _drain_s(self, tokens: float) -> float:
        """Seconds to prefill `tokens` at the measured rate; at least the 503 floor."""
        rate = self.prefill_rate
        return _MIN_503_RETRY_S if rate is None else max(_MIN_503_RETRY_S, tokens / rate)

    def _reject(self, status: int, retry_after: float, reason: str, message: str) -> Rejected:
        self.rejections[reason] += 1
        return Rejected(status, retry_after, reason, message)

    def admit(self, tenant: TenantConfig, priority: str, prompt_tokens: int, max_tokens: int,
              waiting_requests: int, waiting_tokens: int) -> Ticket:
        """Admit the request (charging its tenant) and return its Ticket, or raise `Rejected`
        (429/503, nothing charged) or `Refused` (a request that is wrong, not merely early).
        `waiting_requests` / `waiting_tokens`: requests and prompt tokens queued now, all
        priorities together."""
        assert not self.tenants or tenant.name in self.tenants, "unknown tenant"
        if self.draining:
            raise self._reject(503, self._drain_s(waiting_tokens), "draining",
                               "server is draining; retry on another replica")
        if priority not in PRIORITIES:
            raise Refused(f"priority must be one of {sorted(PRIORITIES)}, got {priority!r}",
                          param="priority")
        if priority not in tenant.priorities:
            raise Refused(f"priority {priority!r} is not allowed for this API key",
                          param="priority")
        if prompt_tokens < 0 or max_tokens < 0:
            raise Refused("prompt_tokens and max_tokens must be >= 0", param="max_tokens")
        cost = prompt_tokens + max_tokens
        if cost > tenant.burst:
            raise Refused(
                f"request needs {cost} tokens (prompt {prompt_tokens} + max_tokens {max_tokens}) "
                f"but this API key's budget holds at most {tenant.burst}; lower max_tokens or "
                f"shorten the prompt", param="max_tokens"
            )
        st = self._tenant_state(tenant)
        if st.in_flight >= tenant.max_concurrent:
            wait = self._service_s.value or _DEFAULT_SERVICE_S
            raise self._reject(429, wait, "tenant_concurrency",
                               f"too many concurrent requests (limit {tenant.max_concurrent})")
        if st.bucket is not None:
            wait = st.bucket.wait_time(cost)
            if wait > 0:
                msg = f"token budget exhausted; {cost} tokens available in {wait:.3f} s"
                raise self._reject(429, wait, "tenant_tokens", msg)
        bound = self.max_waiting
        if priority == "batch":
            bound = max(1, int(self.max_waiting * self.batch_share))
        if waiting_requests >= bound:
            # Time until enough of the queue has drained to fall under the bound.
            excess = waiting_tokens * (waiting_requests - bound + 1) / max(1, waiting_requests)
            msg = f"queue is full ({waiting_requests} waiting; {priority} bound {bound})"
            raise self._reject(503, self._drain_s(excess), "queue_full", msg)
        rate = self.prefill_rate
        if self.slo_ttft_s is not None and rate is not None:
            limit = self.slo_ttft_s * (_INTERACTIVE_SLO_FACTOR if priority == "interactive" else 1)
            est = waiting_tokens / rate
            if est > limit:
                raise self._reject(503, max(_MIN_503_RETRY_S, est - limit), "queue_slo",
                                   f"estimated queue wait {est:.1f} s exceeds {limit:.1f} s")
        if st.bucket is not None:
            taken = st.bucket.try_take(cost)
            assert taken == 0.0, "bucket changed between check and take"
        st.in_flight += 1
        return Ticket(tenant=tenant.name, priority=priority, cost=cost, max_tokens=max_tokens)

    def release(self, ticket: Ticket, generated_tokens: int) -> None:
        """End an admitted request: refund `max_tokens - generated_tokens`, free its concurrency
        slot. Idempotent: a second release of the same ticket does nothing."""
        if ticket.released:
            return
        ticket.released = True
        st = self._state[ticket.tenant]
        assert st.in_flight > 0, "release without a matching admit"
        st.in_flight -= 1
        if st.bucket is not None:
            st.bucket.refund(ticket.max_tokens - min(max(0, generated_tokens), ticket.max_tokens))
