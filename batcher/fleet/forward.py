"""Forward one generation request: pick a replica, retry before the first byte, fail over after.

Contract:
- The client's `X-Request-Id` (or one the router makes) goes to every attempt unchanged, with
  `X-Attempt: n`, so a replica refuses a second copy of a request it runs (409).
- Before the first byte reached the client, a 500/502/503 answer, a refused or broken
  connection, or an eviction of the replica moves the request to another replica (never one it
  tried), at most `max_attempts` in all, with full-jitter backoff (none after a 503: that is
  "try the other candidate"). Each retry spends the fleet retry budget; over budget the client
  gets 503 + Retry-After.
- A stream is committed on its first event and relayed event by event, unbuffered. If the
  replica fails after that: `failover=resume` (completions with one text prompt and n = 1)
  sends prompt + the text already streamed to another replica with `max_tokens` reduced and
  continues the same stream, its final chunk marked `"resumed": true` and `"resumed_at": k`
  (content chunks streamed before the switch); otherwise (`error`, the
  default) the stream ends with an error event carrying `tokens_sent` and `partial_output`, then
  `[DONE]`. Resumes are not charged to the retry budget (they move work, they add none).
- A client disconnect cancels the handler; leaving the upstream request closes its connection,
  and the replica aborts the request and frees its KV.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from batcher.fleet.context import Attempt, RouterContext
from batcher.fleet.registry import Replica
from batcher.fleet.policy import affinity_key, backoff, estimate_tokens
from batcher.fleet.sse import DONE, end_with_error, prepare_resume, relay_events

RETRYABLE = frozenset({500, 502, 503})
PASS_HEADERS = ("Authorization", "x-api-key")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


@dataclass(slots=True)
class Failure:
    reason: str
    capacity: bool = False  # a 503: try the other candidate at once
    response: web.Response | None = None  # the upstream answer, passed on if nothing else works


def error_response(status: int, message: str, code: str, rid: str | None = None,
                   retry_after: int | None = None) -> web.Response:
    kind = {400: "invalid_request_error", 413: "invalid_request_error",
            503: "service_unavailable"}.get(status, "api_error")
    headers = {"X-Request-Id": rid} if rid else {}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return web.Response(status=status, content_type="application/json", headers=headers,
                        body=orjson.dumps({"error": {"message": message, "type": kind,
                                                     "param": None, "code": code}}))


def request_id(request: web.Request) -> str:
    rid = request.headers.get("X-Request-Id")
    if rid is not None and _REQUEST_ID.match(rid):
        return rid
    return "req-" + uuid.uuid4().hex


def choices_count(body: dict[str, Any], chat: bool) -> int:
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return n * len(prompt)
    return n


class Relay:
    """One client request across its attempts."""

    def __init__(self, ctx: RouterContext, request: web.Request, chat: bool,
                 body: dict[str, Any], raw: bytes, rid: str):
        self.ctx, self.request, self.chat, self.body, self.rid = ctx, request, chat, body, rid
        self.payload = raw
        self.tokens = estimate_tokens(body, chat, ctx.cfg.policy)
        self.key = affinity_key(body, chat, ctx.cfg.policy)
        self.tried: set[str] = set()
        self.attempts = 0
        self.last: Failure | None = None
        self.client: web.StreamResponse | None = None
        self.texts: dict[int, list[str]] = {}
        self.finished: set[int] = set()
        self.sent = 0  # content chunks streamed (one token each, as the replica sends them)
        self.sent_before_resume = 0
        self.resumed = False
        self.broke = False  # the stream ended with the explicit error event
        self.budget_refused = False
        self.n = choices_count(body, chat)
        # Token ids make a resume exact (the prompt's ids + the ids streamed so far, instead of
        # re-tokenized text). Ask the replica for them; strip them unless the client asked too.
        self.prompt_ids: list[int] | None = None
        self.ids: dict[int, list[int]] = {}
        self.strip_ids = False
        self.resume_offset = 0  # tokens generated before the current attempt's prompt ids
        if (body.get("failover") == "resume" and body.get("stream") and not chat
                and not body.get("return_token_ids")):
            self.strip_ids = True
            self.payload = orjson.dumps(dict(body, return_token_ids=True))

    @property
    def generated(self) -> int:
        """Tokens streamed so far: exact when the replica sent ids, else content chunks."""
        if self.ids or self.resume_offset:
            return self.resume_offset + sum(len(v) for v in self.ids.values())
        return self.sent

    def outcome(self, resp: web.StreamResponse) -> str:
        """The client-facing outcome label of the finished relay."""
        if self.broke:
            return "stream_error"
        if resp.status == 200:
            return "resumed" if self.resumed else "ok"
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
        rep = ctx.pick(self.tokens, self.key, self.tried)
        if rep is None:
            return self._give_up()
        if self.attempts:
            if charge:
                if not ctx.budget.try_spend(ctx.clock(), ctx.inflight):
                    ctx.metrics.budget_exhausted.inc()
                    self.budget_refused = True
                    return error_response(503, "the fleet's retry budget is spent; retry later",
                                          "retry_budget_exhausted", self.rid, 1)
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
        return h

    def _reply_headers(self, up: aiohttp.ClientResponse) -> dict[str, str]:
        h = {"X-Request-Id": self.rid, "X-Attempt": str(self.attempts)}
        if (ra := up.headers.get("Retry-After")) is not None:
            h["Retry-After"] = ra
        return h

    def _observe(self, rep: Replica, up: aiohttp.ClientResponse) -> None:
        raw = up.headers.get("X-Replica-State")
        if raw:
            try:
                self.ctx.registry.observe(rep.replica_id, orjson.loads(raw), self.ctx.clock())
            except orjson.JSONDecodeError:
                pass

    def _failed(self, rep: Replica, att: Attempt, exc: BaseException) -> Failure:
        if att.killed is not None:
            return Failure(att.killed)
        if isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ClientError):
            self.ctx.report_failure(rep, "an attempt timed out")
            return Failure(f"replica {rep.replica_id} timed out")
        conclusive = isinstance(exc, aiohttp.ClientConnectorError)
        self.ctx.report_failure(rep, f"{type(exc).__name__} on live traffic", conclusive)
        return Failure(f"replica {rep.replica_id} failed: {type(exc).__name__}")

    async def _status(self, up: aiohttp.ClientResponse) -> Failure | web.Response:
        data = await up.read()
        resp = web.Response(status=up.status, body=data, headers=self._reply_headers(up),
                            content_type=up.content_type)
        if up.status in RETRYABLE and self.rid not in self.ctx.cancelled:
            return Failure(f"a replica answered {up.status}", up.status == 503, resp)
        return resp

    async def whole(self) -> web.StreamResponse:
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
        att = ctx.begin(rep, self.tokens)
        ctx.owners[self.rid] = rep.replica_id
        outcome = "error"
        try:
            async with asyncio.timeout(None) as tm:
                att.arm(tm, ctx.cfg.upstream_timeout)
                async with ctx.session.post(rep.url + self.request.path, data=self.payload,
                                            headers=self._headers()) as up:
                    self._observe(rep, up)
                    if up.status != 200:
                        result = await self._status(up)
                        outcome = "client_error" if isinstance(result, web.Response) else (
                            "rejected" if up.status == 503 else "error")
                        return result
                    data = await up.read()
            outcome = "ok"
            return web.Response(body=data, headers=self._reply_headers(up),
                                content_type="application/json")
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return self._failed(rep, att, exc)
        finally:
            self._end(rep, att, outcome)

    def _end(self, rep: Replica, att: Attempt, outcome: str) -> None:
        self.ctx.end(att)
        if self.ctx.owners.get(self.rid) == rep.replica_id:
            del self.ctx.owners[self.rid]
        self.ctx.metrics.attempt(rep.replica_id, rep.version, outcome)

    # streams -------------------------------------------------------------------------------
    async def stream(self) -> web.StreamResponse:
        try:
            while True:
                rep = await self._next(charge=self.client is None)
                if isinstance(rep, web.StreamResponse):
                    if self.client is None:
                        return rep
                    await end_with_error(self, self.last.reason if self.last else "no replica")
                    return self.client
                result = await self._stream_attempt(rep)
                if result is None:
                    return self.client  # type: ignore[return-value]
                if isinstance(result, web.StreamResponse):
                    return result
                self.last = result
                if self.client is None:
                    continue
                if not await prepare_resume(self):
                    return self.client
        except ClientGone:
            return self.client  # type: ignore[return-value]

    async def _stream_attempt(self, rep: Replica) -> Failure | web.StreamResponse | None:
        ctx = self.ctx
        att = ctx.begin(rep, self.tokens, stream=True)
        ctx.owners[self.rid] = rep.replica_id
        outcome = "error"
        buf = bytearray()
        try:
            async with asyncio.timeout(None) as tm:
                att.arm(tm, ctx.cfg.upstream_timeout)  # the first byte may wait in a queue
                async with ctx.session.post(rep.url + self.request.path, data=self.payload,
                                            headers=self._headers()) as up:
                    self._observe(rep, up)
                    if up.status != 200:
                        result = await self._status(up)
                        if isinstance(result, web.Response) and self.client is None:
                            outcome = "client_error"
                            return result
                        outcome = "rejected" if up.status == 503 else "error"
                        return result if isinstance(result, Failure) else Failure(
                            f"a replica answered {up.status} to a resumed stream")
                    async for chunk in up.content.iter_any():
                        att.last_byte = ctx.clock()
                        att.extend(ctx.cfg.stream_idle_timeout)
                        buf += chunk
                        done, failure = await relay_events(self, buf)
                        if failure is not None:
                            return failure
                        if done:
                            outcome = "resumed" if self.resumed else "ok"
                            return None
                    if self.client is not None and len(self.finished) >= self.n:
                        await self.write(DONE, eof=True)  # finished but [DONE] was lost
                        outcome = "ok"
                        return None
                    return Failure(f"replica {rep.replica_id} closed the stream early")
        except (asyncio.CancelledError, ClientGone):
            outcome = "cancelled"
            raise
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return self._failed(rep, att, exc)
        finally:
            self._end(rep, att, outcome)

    async def write(self, data: bytes, eof: bool = False) -> None:
        """To the client; commits the stream on the first write. ClientGone if it left."""
        try:
            if self.client is None:
                self.client = web.StreamResponse(headers={
                    "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no", "X-Request-Id": self.rid,
                    "X-Attempt": str(self.attempts)})
                await self.client.prepare(self.request)
            if data:
                await self.client.write(data)
            if eof:
                await self.client.write_eof()
        except (ConnectionError, RuntimeError) as exc:
            raise ClientGone(str(exc)) from None
