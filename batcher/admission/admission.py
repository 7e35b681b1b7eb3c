"""Admission control: per-tenant token buckets, concurrency caps and a bounded queue that admits a
request only when it can be served within the TTFT and TPOT SLOs.

Each request is charged `prompt_tokens + max_tokens` from its tenant's bucket when admitted and
refunded what it did not generate on `release`. `admit` checks, in this order:

1. draining                       -> 503 `draining`
2. priority not allowed           -> ValueError (400)
3. cost > the tenant's burst      -> ValueError (400: it could never be admitted)
4. tenant at `max_concurrent`     -> 429 `tenant_concurrency`
5. bucket short of `cost` tokens  -> 429 `tenant_tokens`, retry_after exact from the refill rate
6. queue at its bound             -> 503 `queue_full`; interactive may fill `max_waiting`, batch
                                     only `batch_share` of it, so batch is shed first
7. predicted TTFT over the limit  -> 503 `queue_slo`; the prediction (`TtftPredictor`) counts all
                                     unserved prefill ahead of the request (waiting and running,
                                     by priority) at the prefill rate the scheduler achieves,
                                     corrected by the TTFTs it delivered; interactive requests
                                     are admitted within `SloLimit.share` of the SLO, a share
                                     moved by the TTFTs admitted requests get (cut after a miss,
                                     raised while they have slack); batch within
                                     `BATCH_SLO_SHARE / CEILING` of that, so batch is shed first
8. predicted TPOT over the SLO    -> 503 `tpot_slo`: one more decode row would make the running
                                     streams' step (`decode_step_s`) slower than `slo_tpot_s`

Checks 7 and 8 never refuse a request on an idle server: it could not be served sooner by waiting;
nor, with nothing queued ahead of it, when no step has carried prefill for a while (the prediction
is renewed only by prompts that run).
(A request with only decodes ahead is checked: its prompt is read in chunks beside them, and on a
slow machine that alone can take longer than the SLO, where waiting for them to end would not.) A
prompt whose own prefill takes more than half the SLO is admitted when the prompts ahead of it
take at most half the SLO to read, so a long prompt is starved neither by short ones nor by
running streams (its own reading beside them is not counted as a wait).

A 503's retry_after is the predicted time (at least 1 s) for the queue to drain far enough that the
check would pass: the whole queue when draining, the excess over the bound when full, the excess
prediction over the SLO; a TPOT refusal waits one mean service time. A concurrency 429 waits one
mean service time (1 s until measured). Budget is charged only on admission: a 429 or 503 never
costs tokens.

All state lives on the event loop (no locks); `clock` is injectable so tests drive time by hand.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from batcher.core.backlog import Backlog
from batcher.core.refusals import Refused
from batcher.core.stalls import StallLog
from batcher.admission.slo_limit import CEILING, SloLimit
from batcher.admission.tenants import PRIORITIES, TenantConfig
from batcher.admission.token_bucket import TokenBucket
from batcher.admission.ttft_predictor import PrefillStepFn, RateQuery, TtftPredictor

REASONS = ("tenant_tokens", "tenant_concurrency", "queue_full", "queue_slo", "tpot_slo",
           "draining")
# A 503 tells the client to come back no sooner than this: sooner would only add load.
_MIN_503_RETRY_S = 1.0
# Used for a 429 on concurrency until a service time has been measured.
_DEFAULT_SERVICE_S = 1.0
_EWMA_ALPHA = 0.2
# Batch must be predicted within this share of the TTFT SLO (scaled down with the interactive
# share when the controller lowers it): interactive requests admitted after it are served first
# and delay it past its prediction, and under overload batch is shed first.
BATCH_SLO_SHARE = 0.5
# New streams are admitted while the predicted step stays within this share of the TPOT SLO (and
# interactive requests within this share of the TTFT SLO at most, `slo_limit.CEILING`): the
# predictions follow recent history, and the rest absorbs what changes between admission and the
# tokens (steps slowed by another process, a preemption).
SLO_HEADROOM = CEILING
# Predicted seconds of one engine step carrying `rows` decode rows, the longest at context `ctx`
# (the shared step-time model), or None while it has no estimate.
DecodeStepFn = Callable[[int, int], "float | None"]


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


@dataclass(slots=True)
class Ticket:
    """One admitted request; hand it back to `Admission.release` exactly when it ends."""

    tenant: str
    cost: int
    max_tokens: int
    priority: str = "interactive"
    released: bool = False
    admitted_at: float = 0.0
    # Uncorrected TTFT prediction at admission (None: no estimate yet), compared with the actual
    # first token to correct later predictions.
    predicted_ttft_s: float | None = None
    # The prefill rate that prediction used, and what it was asked for (`TtftPredictor.
    # rate_query`): a change of that rate since is the raw model's to follow, not the correction's.
    predicted_at_rate: float | None = None
    rate_query: RateQuery | None = None
    first_token_seen: bool = False
    # Admitted because predicted within the SLO limit (not alone on an idle server, not a long
    # prompt held by its wait only): its TTFT is evidence for the limit's controller.
    held_to_slo: bool = False
    # The corrected prediction it was admitted on.
    predicted_corrected_s: float = 0.0


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
    batch requests may fill. `slo_tpot_s` is enforced once `decode_step_s` is given;
    `max_num_seqs` caps the decode rows a step can carry (more requests wait for a slot).
    """

    tenants: dict[str, TenantConfig] | None
    max_waiting: int = 256
    slo_ttft_s: float | None = None
    clock: Callable[[], float] = time.monotonic
    batch_share: float = 0.5
    slo_tpot_s: float | None = None
    decode_step_s: DecodeStepFn | None = None
    max_num_seqs: int = 1 << 30
    # The scheduler's prefill chunk beside so many decodes and its step's price (see
    # `TtftPredictor.prefill_step`).
    prefill_step: PrefillStepFn | None = None
    predictor: TtftPredictor = field(default_factory=TtftPredictor)
    limit: SloLimit = field(default_factory=SloLimit)
    # The engine's stalls (a compile, a pause of the process): time a request waited through
    # one is not held against the server's capacity (`batcher.core.stalls`).
    stalls: StallLog = field(default_factory=StallLog)
    draining: bool = field(default=False, init=False)
    # Rejections by reason, for the `requests_rejected{reason}` metric.
    rejections: dict[str, int] = field(init=False)
    _state: dict[str, _TenantState] = field(default_factory=dict, init=False, repr=False)
    _service_s: _Ewma = field(default_factory=_Ewma, init=False, repr=False)

    def __post_init__(self) -> None:
        self.rejections = dict.fromkeys(REASONS, 0)
        if self.prefill_step is not None:
            self.predictor.prefill_step = self.prefill_step
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.slo_ttft_s is not None and not self.slo_ttft_s > 0:
            raise ValueError(f"slo_ttft_s must be > 0, got {self.slo_ttft_s}")
        if self.slo_tpot_s is not None and not self.slo_tpot_s > 0:
            raise ValueError(f"slo_tpot_s must be > 0, got {self.slo_tpot_s}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0 < self.batch_share <= 1:
            raise ValueError(f"batch_share must be in (0, 1], got {self.batch_share}")

    # -- measurements -------------------------------------------------------------------------

    def observe_step(self, seconds: float, prefill_tokens: int, pending_after: bool,
                     decode_rows: int = 0, modelled_s: float | None = None,
                     step_modelled_s: float | None = None, prefill_left: bool = True) -> None:
        """Feed one engine step that just ended: its model time, the prompt tokens it computed,
        the decodes beside them, whether the engine still has work, the step-time model's
        prediction for its decodes and for the whole step, and whether prompt tokens were left
        waiting (see `TtftPredictor.observe_step`)."""
        self.predictor.observe_step(self.clock(), seconds, prefill_tokens, pending_after,
                                    decode_rows, modelled_s, step_modelled_s, prefill_left)

    def observe_first_token(self, ticket: Ticket) -> None:
        """The admitted request's first token is out: compare with its prediction (once)."""
        if ticket.first_token_seen:
            return
        ticket.first_token_seen = True
        now = self.clock()
        # NOTE: a stall delayed this first token by the same amount as every other in flight;
        # it tells nothing about how much the server can take, so neither the controller nor
        # the correction learns from it.
        waited = max(0.0, now - ticket.admitted_at - self.stalls.overlap(ticket.admitted_at, now))
        if ticket.held_to_slo and self.slo_ttft_s is not None:
            self.limit.observe(now, ticket.admitted_at, waited, self.slo_ttft_s)
        if ticket.predicted_ttft_s is not None:
            predicted = ticket.predicted_ttft_s
            rate_now = (self.predictor.prefill_rate if ticket.rate_query is None
                        else self.predictor.prefill_rate_with(*ticket.rate_query))
            if ticket.predicted_at_rate is not None and rate_now is not None:
                # What the raw model would predict now that it has seen the rate change.
                predicted *= ticket.predicted_at_rate / rate_now
            self.predictor.observe_ttft(now, predicted, waited)

    def observe_service(self, seconds: float) -> None:
        """Feed one finished request's service time (admission to last token)."""
        if seconds > 0:
            self._service_s.add(seconds)

    @property
    def prefill_rate(self) -> float | None:
        """Achieved prefill tokens per second, or None before the first measurement."""
        return self.predictor.prefill_rate

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
        """Predicted seconds to prefill `tokens`; at least the 503 floor."""
        wait = self.predictor.drain_s(self.clock(), tokens)
        return _MIN_503_RETRY_S if wait is None else max(_MIN_503_RETRY_S, wait)

    def _reject(self, status: int, retry_after: float, reason: str, message: str) -> Rejected:
        self.rejections[reason] += 1
        return Rejected(status, retry_after, reason, message)

    def admit(self, tenant: TenantConfig, priority: str, prompt_tokens: int, max_tokens: int,
              backlog: Backlog, requests: int = 1) -> Ticket:
        """Admit the request (charging its tenant) and return its Ticket, or raise `Rejected`
        (429/503, nothing charged) or `Refused` (a request that is wrong, not merely early).
        `backlog`: the engine's unserved work now; `requests`: engine requests this one becomes
        (prompts x n), `prompt_tokens` and `max_tokens` being their totals."""
        assert not self.tenants or tenant.name in self.tenants, "unknown tenant"
        if self.draining:
            raise self._reject(503, self._drain_s(backlog.ahead_batch), "draining",
                               "server is draining; retry on another replica")
        if priority not in PRIORITIES:
            raise Refused(f"priority must be one of {sorted(PRIORITIES)}, got {priority!r}",
                          param="priority")
        if priority not in tenant.priorities:
            raise Refused(f"priority {priority!r} is not allowed for this API key",
                          param="priority")
        if prompt_tokens < 0 or max_tokens < 0 or requests < 1:
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
        waiting = backlog.waiting + requests - 1
        if waiting >= bound:
            # Time until enough of the queue has drained to fall under the bound.
            excess = backlog.ahead_batch * (waiting - bound + 1) / max(1, waiting)
            msg = f"queue is full ({waiting} waiting; {priority} bound {bound})"
            raise self._reject(503, self._drain_s(excess), "queue_full", msg)
        now = self.clock()
        ahead = backlog.ahead(priority)
        raw = self.predictor.predict_raw(backlog, priority, prompt_tokens)
        # NOTE: with nothing queued ahead, one request is also let in when every prefill rate is
        # stale: the prediction learns only from steps that run, and one that went pessimistic
        # (measured while the machine was slower) would otherwise refuse until the server idles.
        first = ahead == 0 and backlog.queued_ahead(priority) == 0 and backlog.free_slots > 0
        idle = first and (backlog.running == 0 or self.predictor.prefill_stale)
        held = False
        if self.slo_ttft_s is not None and raw is not None and not idle:
            self.limit.check_waiting(now, self.slo_ttft_s, self.stalls.overlap)
            held = self._check_ttft(now, priority, prompt_tokens, raw, backlog)
        if self.slo_tpot_s is not None and self.decode_step_s is not None:
            self._check_tpot(backlog, requests, (prompt_tokens + max_tokens) // requests)
        if st.bucket is not None:
            taken = st.bucket.try_take(cost)
            assert taken == 0.0, "bucket changed between check and take"
        st.in_flight += 1
        query = self.predictor.rate_query(backlog, priority, prompt_tokens)
        ticket = Ticket(tenant=tenant.name, priority=priority, cost=cost, max_tokens=max_tokens,
                        admitted_at=now, predicted_ttft_s=raw,
                        predicted_at_rate=self.predictor.prefill_rate_with(*query),
                        rate_query=query, held_to_slo=held)
        if held and raw is not None:
            ticket.predicted_corrected_s = raw * self.predictor.correction(now)
            self.limit.watch(ticket)
        return ticket

    def ttft_limit_s(self, priority: str) -> float | None:
        """Predicted TTFT (seconds) up to which a request of `priority` is admitted now."""
        if self.slo_ttft_s is None:
            return None
        share = self.limit.share
        if priority == "batch":
            share *= BATCH_SLO_SHARE / CEILING
        return self.slo_ttft_s * share

    def _check_ttft(self, now: float, priority: str, own: int, raw: float,
                    backlog: Backlog) -> bool:
        """Refuse (503 `queue_slo`) when the predicted TTFT is over this priority's limit;
        True when the request is held to the whole limit (not a long prompt)."""
        limit = self.ttft_limit_s(priority)
        assert limit is not None
        corr = self.predictor.correction(now)
        predicted = raw * corr
        # NOTE: long by its own prefill on a quiet server: beside decodes, on a slow machine,
        # even a short prompt takes long, and admitting it would only make it miss.
        own_s = self.predictor.quiet_prefill_s(now, own) or 0.0
        # NOTE: long against the limit at its widest: while the controller holds the share low,
        # an ordinary prompt must not pass as a long one and skip the check.
        widest = self.slo_ttft_s * (BATCH_SLO_SHARE if priority == "batch" else CEILING)
        held = own_s <= widest / 2
        if not held:
            # A long prompt: hold only its wait behind the prompts ahead of it to half the
            # limit. Reading its own prompt beside running streams, at the pace that keeps their
            # tokens coming, is its own length, not a queue: counting it would refuse a long
            # prompt for as long as streams run.
            ahead = self.predictor.predict_raw(backlog, priority, 0) or 0.0
            predicted, limit = ahead * corr, limit / 2
        if predicted > limit:
            raise self._reject(503, max(_MIN_503_RETRY_S, predicted - limit), "queue_slo",
                               f"predicted time to first token {predicted:.2f} s exceeds the "
                               f"{limit:.2f} s this server admits for {priority} requests")
        return held

    def _check_tpot(self, backlog: Backlog, requests: int, context: int) -> None:
        """Refuse (503 `tpot_slo`) when the decode rows this request adds would make the running
        streams' step slower than the TPOT SLO. Rows past `max_num_seqs` wait for a slot and
        slow nobody's step; a request alone on the server is never refused."""
        assert self.slo_tpot_s is not None and self.decode_step_s is not None
        before = min(self.max_num_seqs, backlog.running + backlog.waiting)
        rows = min(self.max_num_seqs, before + requests)
        if rows == before or before == 0:
            return
        step = self.decode_step_s(rows, max(backlog.max_context, context))
        if step is not None:
            # A stream waits for the step's wall time, event loop and busy machine included.
            step *= self.predictor.wall_factor
        limit = self.slo_tpot_s * SLO_HEADROOM
        if step is not None and step > limit:
            wait = self._service_s.value or _DEFAULT_SERVICE_S
            raise self._reject(503, max(_MIN_503_RETRY_S, wait), "tpot_slo",
                               f"{rows} streams would take {step * 1000:.0f} ms per token, over "
                               f"the {limit * 1000:.0f} ms this server admits new streams at")

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
