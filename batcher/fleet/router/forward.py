"""Forward one generation request: pick a replica, retry before the first byte, fail over after.

Contract:
- The client's `X-Request-Id` (or one the router makes) goes to every attempt unchanged, with
  `X-Attempt: n`, so a replica refuses a second copy of a request it runs (409). On the router
  the id is the caller's own (scoped by its credential, as a replica scopes it by tenant), and so
  is prefix affinity.
- A body whose prompt the routing estimates cannot read goes to a replica as it is: the
  replica's 400, naming the field, is the answer.
- Before the first byte reached the client, a 500/502/503 answer, a refused or broken
  connection, or an eviction of the replica moves the request to another replica (never one it
  tried), at most `max_attempts` in all, with full-jitter backoff (none after a 503: that is
  "try the other candidate"). A 4xx, or a 500 the replica marks `x-should-retry: false` (the
  request's own fault), is the answer and is not retried. A retry after an answer (500/502/503)
  or a timeout spends the caller's retry budget (kept per credential scope, so one caller's
  failing requests cannot spend everyone's); over budget the client gets 503 + Retry-After. A
  replica that died or became unreachable (refused or broken connection, eviction) before the
  first byte is failover, not overload: moving the request adds no work to the fleet, so it
  spends no budget (still at most `max_attempts` in all, and the dead replica leaves the pool).
- A stream is committed on its first event and relayed event by event, unbuffered. If the
  replica fails after that: `failover=resume` (completions with one text prompt and n = 1)
  sends prompt + the text already streamed to another replica with `max_tokens` reduced and
  continues the same stream, its final chunk marked `"resumed": true` and `"resumed_at": k`
  (content chunks streamed before the switch); otherwise (`error`, the
  default) the stream ends with an error event carrying `tokens_sent` and `partial_output`, then
  `[DONE]` (on /v1/messages Anthropic's `error` event, on /v1/responses `response.failed`, as
  each API's clients read a failure). Resumes are not charged to the retry budget (they move
  work, they add none). What the client saw is kept by `stream_ledger.StreamLedger`;
  `stream_relay.StreamRelay` does the I/O. Retries and failovers are counted by the relays
  (`batcher_retries`, `batcher_failovers{kind}`).
- A client disconnect cancels the handler; leaving the upstream request closes its connection,
  and the replica aborts the request and frees its KV.
- The access line says what the client got, as a replica's does: the `outcome`, the error code
  of an error answer (the replica's `X-Reject-Reason` or `error.code`, relayed, or the router's
  own), the last `finish_reason` relayed, and for a stream cut before its usage chunk the tokens
  relayed (`route_timing.RelayedTimings`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from batcher.telemetry.access_log import LOGGED, log_access, outcome_of
from batcher.fleet.router.context import Attempt, RouterContext
from batcher.fleet.router.registry import Replica
from batcher.fleet.router.request_estimates import (
    affinity_key,
    choices_count,
    estimate_prompt_tokens,
    estimate_tokens,
    responses_as_chat,
    well_formed,
)
from batcher.fleet.router.responses_proxy import tag_body
from batcher.fleet.router.retry_budget import backoff
from batcher.fleet.router.route_timing import RelayedTimings, RouteClock
from batcher.fleet.router.stream_ledger import RESPONSES_PATH, StreamLedger
from batcher.http.errors import ApiError
from batcher.http.keys import FLEET_KEY_HEADER, TENANT_HEADER
from batcher.http.middleware import error_code_of
from batcher.http.upstream import UpstreamConnectError, UpstreamError, UpstreamResponse
from batcher.telemetry.timings import Timings
from batcher.telemetry.tracing import current as current_tracer
from batcher.telemetry.tracing import forward_headers

RETRYABLE = frozenset({500, 502, 503})
PASS_HEADERS = ("Authorization", "x-api-key")
# A replica writes compact JSON; `null` (a chunk before the last) does not match. The key cannot
# occur inside a JSON string, whose quotes are escaped.
_FINISH_MARK = b'"finish_reason":"'
_FINISH = re.compile(rb'"finish_reason":"([a-z_]{1,32})"')


def finish_reason_in(data: bytes) -> str | None:
    """The last finish reason a whole answer or a run of stream events names, or None."""
    if _FINISH_MARK not in data:
        return None
    found = _FINISH.findall(data)
    return found[-1].decode() if found else None


@dataclass(slots=True)
class Failure:
    reason: str
    capacity: bool = False  # a 503: try the other candidate at once
    response: web.Response | None = None  # the upstream answer, passed on if nothing else works
    lost: bool = False  # the replica died or became unreachable: failover, not an overload retry


def error_response(status: int, message: str, code: str, rid: str | None = None,
                   retry_after: int | None = None) -> web.Response:
    return ApiError(status, message, code=code, retry_after=retry_after).response(rid)


class Relay:
    """One client request across its attempts."""

    def __init__(self, ctx: RouterContext, request: web.Request, chat: bool,
                 body: dict[str, Any], raw: bytes, rid: str, scope: str = ""):
        self.ctx, self.request, self.chat, self.body, self.rid = ctx, request, chat, body, rid
        # The router's `route` phase runs from here to the answer.
        self.route = RouteClock(observe=lambda t: ctx.later(ctx.metrics.observe_phases, t))
        tracer = current_tracer()
        self.span = None if tracer is None else tracer.open("batcher.router", request.headers)
        self.rkey = (scope, rid)  # request ids are the caller's own, as on a replica
        self.tenant: str | None = None  # as the replica named it (TENANT_HEADER)
        self.payload = raw
        policy = ctx.cfg.policy
        self.tokens, self.key = policy.default_max_tokens, None
        self.prompt_tokens = 1
        # The estimates read chat's fields; a Responses body is read as its chat equivalent.
        shape = responses_as_chat(body) if request.path == RESPONSES_PATH else body
        if well_formed(shape, chat):
            self.tokens = estimate_tokens(shape, chat, policy)
            self.prompt_tokens = estimate_prompt_tokens(shape, chat, policy)
            key = affinity_key(shape, chat, policy)
            # Affinity only within one caller: another tenant's prefix is never a reason to
            # land on the replica that caches it (prefix caches are per tenant too).
            self.key = None if key is None else f"{scope}\x00{key}"
        self.tried: set[str] = set()
        self.attempts = 0
        self.last: Failure | None = None
        self.client: web.StreamResponse | None = None
        self.budget_refused = False
        self.gone = False  # the client left: the handler was cancelled or a write failed
        self.finish_reason: str | None = None  # the last one relayed, for the access line
        # Token ids make a resume exact (the prompt's ids + the ids streamed so far, instead of
        # re-tokenized text): ask the replica for them.
        strip = bool(body.get("failover") == "resume" and body.get("stream") and not chat
                     and not body.get("return_token_ids"))
        if strip:
            self.payload = orjson.dumps(dict(body, return_token_ids=True))
        self.ledger = StreamLedger(chat, choices_count(body, chat), strip_ids=strip,
                                   path=request.path)
        # A stored response's ids name the replica that made it (`responses_proxy.py`).
        self.tag_responses = request.path == RESPONSES_PATH

    def set_body(self, body: dict[str, Any]) -> None:
        """Send `body` instead of what the client sent (the routing estimates stand)."""
        self.body = body
        self.payload = orjson.dumps(body)

    def outcome(self, resp: web.StreamResponse) -> str:
        """The client-facing outcome label of the finished relay."""
        if self.ledger.broke:
            return "stream_error"
        if resp.status == 200:
            return "resumed" if self.ledger.resumed else "ok"
        if self.budget_refused:
            return "budget_exhausted"
        if resp.status == 503:
            return "rejected" if self.attempts else "no_replica"
        return "client_error" if resp.status < 500 else "error"

    # choosing the next replica -----------------------------------------------------------------
    async def _next(self, charge: bool) -> Replica | web.Response:
        ctx = self.ctx
        if self.attempts >= ctx.cfg.max_attempts:
            return self._give_up()
        rep = ctx.pick(self.tokens, self.key, self.tried, self.prompt_tokens)
        if rep is None:
            return self._give_up()
        if self.attempts:
            lost = self.last is not None and self.last.lost
            if charge and lost:
                ctx.metrics.retries.labels("replica_lost").inc()
                ctx.metrics.failovers.labels("retry").inc()
            elif charge:
                if not ctx.budget.try_spend(ctx.clock(), self.rkey[0]):
                    ctx.metrics.budget_exhausted.inc()
                    self.budget_refused = True
                    return error_response(503, "your retry budget on this fleet is spent; retry "
                                          "later", "retry_budget_exhausted", self.rid, 1)
                ctx.metrics.retries.labels("capacity" if self.last and self.last.capacity
                                           else "failure").inc()
                ctx.metrics.failovers.labels("retry").inc()
            if not (self.last and self.last.capacity):
                cfg = ctx.cfg
                await asyncio.sleep(backoff(self.attempts - 1, cfg.backoff_base,
                                            cfg.backoff_cap, ctx.rng.random()))
        self.tried.add(rep.replica_id)
        self.attempts += 1
        return rep

    def _give_up(self) -> web.Response:
        last = self.last
        if last is not None and last.response is not None:
            return last.response
        if last is not None:
            return error_response(503, f"no replica could serve the request: {last.reason}",
                                  "upstream_unavailable", self.rid, 1)
        return error_response(503, "no replica is ready to serve", "no_replica", self.rid, 1)

    # one upstream attempt ----------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        h = {k: v for k in PASS_HEADERS if (v := self.request.headers.get(k)) is not None}
        h.update({"Content-Type": "application/json", "X-Request-Id": self.rid,
                  "X-Attempt": str(self.attempts)})
        if self.ctx.cfg.fleet_key:  # the replica piggybacks its state for the fleet only
            h[FLEET_KEY_HEADER] = self.ctx.cfg.fleet_key
        h.update(forward_headers(self.request.headers, self.span))
        return h

    def _reply_headers(self, up: UpstreamResponse) -> dict[str, str]:
        h = {"X-Request-Id": self.rid, "X-Attempt": str(self.attempts)}
        if (ra := up.headers.get("Retry-After")) is not None:
            h["Retry-After"] = ra
        # Why a replica refused, for the client and for the router's own access line.
        if (why := up.headers.get("X-Reject-Reason")) is not None:
            h["X-Reject-Reason"] = why
        # The replica knows whether its answer is worth a client's retry (OpenAI's SDKs obey it).
        if (retry := up.headers.get("x-should-retry")) is not None:
            h["x-should-retry"] = retry
        return h

    def _observe(self, rep: Replica, up: UpstreamResponse, att: Attempt) -> None:
        """The replica's state on its answer. A stream's (200) was taken as its first event
        left, and counts the request as running: read at once, so that its end counts as since
        it. Any other answer's was taken after the request left the replica's scheduler: read
        once the attempt has ended (`_end`), or its end would count twice."""
        self.tenant = up.headers.get(TENANT_HEADER) or self.tenant
        raw = up.headers.get("X-Replica-State")
        if not raw:
            return
        if att.stream and up.status == 200:
            self._read_state(rep, raw)
        else:
            att.state_after = raw

    def _read_state(self, rep: Replica, raw: str, at: float | None = None) -> None:
        """`raw` as `rep`'s state seen at `at` (now by default): a fresher state that arrived
        in between (a heartbeat, a stream's answer) is kept."""
        try:
            self.ctx.registry.observe(rep.replica_id, orjson.loads(raw),
                                      self.ctx.clock() if at is None else at)
        except orjson.JSONDecodeError:
            pass

    def _failed(self, rep: Replica, att: Attempt, exc: BaseException) -> Failure:
        if att.killed is not None:  # evicted by health: the replica is gone
            return Failure(att.killed, lost=True)
        if isinstance(exc, TimeoutError):  # slow is not dead: a retry here is overload's
            self.ctx.report_failure(rep, "an attempt timed out")
            return Failure(f"replica {rep.replica_id} timed out")
        conclusive = isinstance(exc, UpstreamConnectError)
        what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.ctx.report_failure(rep, f"{what} on live traffic", conclusive)
        return Failure(f"replica {rep.replica_id} failed: {what}", lost=True)

    async def _status(self, up: UpstreamResponse) -> Failure | web.Response:
        data = await up.read()
        resp = web.Response(status=up.status, body=data, headers=self._reply_headers(up),
                            content_type=up.content_type)
        # NOTE: a 500 the replica marks `x-should-retry: false` is the request's own doing (the
        # same body fails the same way anywhere): the answer, not a reason to spend the budget.
        own_fault = up.status == 500 and up.headers.get("x-should-retry") == "false"
        if up.status in RETRYABLE and not own_fault and self.rkey not in self.ctx.cancelled:
            return Failure(f"a replica answered {up.status}", up.status == 503, resp)
        return resp

    async def whole(self) -> web.StreamResponse:
        return await self._logged(self._whole)

    async def _logged(self, relay: Callable[[], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        """Run one of the relay's entry points (`_whole`, `_stream`) and write its access line
        as the answer leaves, however it ends."""
        resp: web.StreamResponse | None = None
        try:
            resp = await relay()
            return resp
        except asyncio.CancelledError:  # the client went away
            self.gone = True
            raise
        finally:
            self._done(resp)

    def _done(self, resp: web.StreamResponse | None) -> None:
        """The access line, as the answer leaves: the status the client got (499 when it left
        before any; 500 when the relay failed), and how the request ended."""
        self.request[LOGGED] = True  # the line is this relay's, with its phases
        status = resp.status if resp is not None else 499 if self.gone else 500
        code = None if resp is None else error_code_of(resp)
        if self.gone:
            outcome = "client_disconnect"
        elif self.ledger.broke:  # the stream ended with the explicit error event
            outcome, code = "error", code or "upstream_failed"
        else:
            outcome = outcome_of(status)
        timings = self.route.timings
        if timings is None and self.ledger.generated:  # a stream ended before its usage chunk
            timings = RelayedTimings(total_ms=self.route.elapsed_ms(),
                                     completion_tokens=self.ledger.generated)
        self.ctx.later(self._record, status, code, outcome, timings)

    def _record(self, status: int, code: str | None, outcome: str,
                timings: Timings | None) -> None:
        """The trace span ends and the access line is written (no prompt, no key: the caller
        appears as the tenant its replica named, else as its credential's digest)."""
        if self.span is not None:
            self.span.set_attribute("batcher.request_id", self.rid)
            self.span.set_attribute("batcher.attempts", self.attempts)
            self.span.end()
        log_access(request_id=self.rid, tenant=self.tenant or self.rkey[0],
                   route=self.request.path, status=status, timings=timings,
                   finish_reason=self.finish_reason, error_code=code, outcome=outcome)

    async def _whole(self) -> web.StreamResponse:
        while True:
            rep = await self._next(charge=True)
            if isinstance(rep, web.StreamResponse):
                return rep
            result = await self._whole_attempt(rep)
            if isinstance(result, web.StreamResponse):
                return result
            self.last = result

    async def _whole_attempt(self, rep: Replica) -> Failure | web.StreamResponse:
        ctx = self.ctx
        att = ctx.begin(rep, self.tokens, prompt_tokens=self.prompt_tokens)
        ctx.owners[self.rkey] = rep.replica_id
        outcome = "error"
        try:
            async with asyncio.timeout(None) as tm:
                att.arm(tm, ctx.cfg.upstream_timeout)
                async with ctx.upstream.post(ctx.upstream_url(rep, self.request.path),
                                             self.payload, self._headers()) as up:
                    self._observe(rep, up, att)
                    if up.status != 200:
                        result = await self._status(up)
                        outcome = "client_error" if isinstance(result, web.Response) else (
                            "rejected" if up.status == 503 else "error")
                        return result
                    data = await up.read()
            outcome = "ok"
            headers = self._reply_headers(up)
            if self.tag_responses:
                data = tag_body(data, rep.replica_id)
            data = self.route.whole(data, headers)
            self.finish_reason = finish_reason_in(data)
            return web.Response(body=data, headers=headers, content_type="application/json")
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except (TimeoutError, UpstreamError, OSError) as exc:
            return self._failed(rep, att, exc)
        finally:
            self._end(rep, att, outcome)

    def _end(self, rep: Replica, att: Attempt, outcome: str) -> None:
        self.ctx.end(att)
        if att.state_after is not None:  # after the end, and after the answer left, as of now
            self.ctx.later(self._read_state, rep, att.state_after, self.ctx.clock())
        if self.ctx.owners.get(self.rkey) == rep.replica_id:
            del self.ctx.owners[self.rkey]
        self.ctx.later(self.ctx.metrics.attempt, rep.replica_id, rep.version, outcome)
