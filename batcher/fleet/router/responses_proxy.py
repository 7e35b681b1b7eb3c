"""Stored responses behind a router: which replica holds `previous_response_id`, and GET and
DELETE of `/v1/responses/{id}`.

A stored response lives on the replica that made it. The router hands out ids that name that
replica, as the batch tier's do (`batch_ids.py`: `resp_<hex>.<owner>`): the ids of a response
created through the router are rewritten on the way out (its `id` and `previous_response_id`, in
whole answers and in the stream's response objects) and back on the way in. A tagged id goes to
its owner only: a continuation is routed there with no lookup (a 503 + Retry-After while the
owner is draining, evicted or unready; a 404 when the router no longer knows it), GET and DELETE
ask it alone. The router keeps nothing (it stays soft state: a restarted router, or several side
by side, route the same ids the same way); a forged tag can name only a replica the router
already routes to, and a replica answers only for the caller's tenant, so another tenant's id
is a 404 as on a replica.

An untagged id (one a replica made for a client that called it directly) is looked for on every
trusted replica, in parallel and with the caller's own key; the one that answers 200 holds it
(draining or not); its 200 ends the lookup and the other questions are cancelled, so a hung
replica delays nobody. These fan-outs are bounded per caller (`MAX_FANOUTS_PER_SCOPE` at once,
then 429 + Retry-After), so one caller's cheap requests cannot multiply across the fleet. When
none holds it but a registered replica could not be asked (evicted, unhealthy, not ready), the
answer is a 503 + Retry-After, not a 404 that would look permanent.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from batcher.fleet.router import batch_ids
from batcher.fleet.router.context import RouterContext
from batcher.fleet.router.registry import Replica
from batcher.http.errors import ApiError

LOOKUP_TIMEOUT_S = 5.0
# Untagged lookups one caller (credential scope) may have in flight at once; each asks every
# replica.
MAX_FANOUTS_PER_SCOPE = 4


def not_found(rid: str, param: str) -> ApiError:
    return ApiError(404, f"no response '{rid}' is stored for this key on any routable replica",
                    param=param, code="response_not_found")


def unavailable(rid: str) -> ApiError:
    return ApiError(503, f"the replica holding response '{rid}' cannot answer now",
                    code="upstream_unavailable", retry_after=1)


def tag(obj: Any, owner: str) -> Any:
    """A response object from replica `owner` with its ids as the router hands them out."""
    return batch_ids.outward(obj, owner, batch_ids.RESPONSE_ID_FIELDS)


def tag_body(data: bytes, owner: str) -> bytes:
    """A whole /v1/responses answer with its ids tagged; anything not a JSON object unchanged."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data
    return orjson.dumps(tag(obj, owner)) if isinstance(obj, dict) else data


@dataclass(slots=True)
class Holder:
    """Where response `rid` lives, as its id says: the replica's own id for it and the owner
    replica; `rep` is None when the router does not know the owner."""

    inner: str
    owner: str
    rep: Replica | None


def holder(ctx: RouterContext, rid: str) -> Holder | None:
    """The owner a tagged id names, or None for an untagged id."""
    decoded = batch_ids.decode(rid)
    if decoded is None:
        return None
    inner, owner = decoded
    return Holder(inner, owner, ctx.registry.get(owner))


@contextlib.contextmanager
def _fan_out_slot(ctx: RouterContext, scope: str):  # type: ignore[no-untyped-def]
    """One of the caller's untagged lookups; 429 + Retry-After past MAX_FANOUTS_PER_SCOPE."""
    running = ctx.lookups
    n = running.get(scope, 0)
    if n >= MAX_FANOUTS_PER_SCOPE:
        raise ApiError(429, f"at most {MAX_FANOUTS_PER_SCOPE} lookups of untagged response ids "
                       "at once per key", code="too_many_lookups", retry_after=1)
    running[scope] = n + 1
    try:
        yield
    finally:
        left = running[scope] - 1
        if left:
            running[scope] = left
        else:
            del running[scope]


async def _question(ctx: RouterContext, method: str, url: str, path: str,
                    headers: Mapping[str, str]) -> tuple[int, bytes, str]:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with ctx.session.request(
                method, url + path, headers=headers,
                timeout=aiohttp.ClientTimeout(total=LOOKUP_TIMEOUT_S)) as resp:
            return resp.status, await resp.read(), resp.content_type
    return 0, b"", ""


def _path(rid: str) -> str:
    return "/v1/responses/" + urllib.parse.quote(rid, safe="", errors="surrogateescape")


async def ask(ctx: RouterContext, method: str, rid: str, headers: Mapping[str, str],
              scope: str = "") -> tuple[str | None, web.Response | None]:
    """(the id of the replica holding response `rid`, its answer to `method` there); when none
    holds it, (None, the first answer that was neither 200 nor 404, or a 503 when a replica did
    not answer), or (None, None) when every replica said 404. A tagged id is asked of its
    owner alone; an untagged one of every trusted replica (bounded per `scope`)."""
    held = holder(ctx, rid)
    if held is not None:
        return await _ask_owner(ctx, method, held, headers)
    with _fan_out_slot(ctx, scope):
        return await _fan_out(ctx, method, rid, headers)


async def _ask_owner(ctx: RouterContext, method: str, held: Holder,
                     headers: Mapping[str, str]) -> tuple[str | None, web.Response | None]:
    rep = held.rep
    if rep is None:
        return None, None
    if not ctx.registry.trusted(rep):
        return None, unavailable(batch_ids.encode(held.inner, held.owner)).response()
    status, body, ctype = await _question(ctx, method, rep.url, _path(held.inner), headers)
    if status == 200:
        return held.owner, web.Response(body=tag_body(body, held.owner), content_type=ctype)
    if status == 0:
        return None, unavailable(batch_ids.encode(held.inner, held.owner)).response()
    if status == 404:
        return None, None
    return None, web.Response(status=status, body=body, content_type=ctype)


async def _fan_out(ctx: RouterContext, method: str, rid: str, headers: Mapping[str, str]
                   ) -> tuple[str | None, web.Response | None]:
    # Trusted, draining or not: a draining replica still holds its responses.
    reps = [r for r in ctx.registry if ctx.registry.trusted(r)]
    path = _path(rid)
    # The holder's 200 answers at once: a replica that hangs delays nobody once it came.
    tasks = {asyncio.ensure_future(_question(ctx, method, r.url, path, headers)): r
             for r in reps}
    answers: list[tuple[int, bytes, str]] = []
    other: web.Response | None = None
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                status, body, ctype = task.result()
                answers.append((status, body, ctype))
                if status == 200:
                    return tasks[task].replica_id, web.Response(body=body, content_type=ctype)
                if status not in (0, 404) and other is None:
                    other = web.Response(status=status, body=body, content_type=ctype)
    finally:
        for task in tasks:
            task.cancel()
    if other is None and any(status == 0 for status, _, _ in answers):
        other = ApiError(503, "a replica that may hold the response did not answer",
                         code="upstream_unavailable", retry_after=1).response()
    if other is None and any(not ctx.registry.trusted(r) for r in ctx.registry):
        # A registered replica the router cannot ask now (evicted, unhealthy, not ready) may
        # hold it: a 404 would look permanent.
        other = ApiError(503, "a replica that may hold the response is unavailable",
                         code="upstream_unavailable", retry_after=1).response()
    return None, other


@dataclass(slots=True)
class Pin:
    """Where a continuation must go: `elsewhere` (every replica but the holder) is excluded;
    `inner` is the holder's own id for the previous response (the body is rewritten to it)."""

    elsewhere: set[str]
    inner: str | None = None


async def pin_previous(ctx: RouterContext, body: dict[str, Any], headers: Mapping[str, str],
                       scope: str = "") -> Pin | web.Response:
    """Where a request must go: to the holder of its `previous_response_id` (anywhere without
    one). When no replica holds it: a 404, or the replicas' own refusal (a bad key is a 401 as
    on a replica)."""
    prev = body.get("previous_response_id")
    if not isinstance(prev, str) or not prev:
        return Pin(set())  # the replica validates it
    held = holder(ctx, prev)
    if held is not None:
        # The id names its replica: no lookup; the replica itself answers 404 when it does
        # not hold it (for this tenant).
        if held.rep is None:
            return not_found(prev, "previous_response_id").response()
        return Pin({r.replica_id for r in ctx.registry if r.replica_id != held.owner},
                   held.inner)
    owner, answer = await ask(ctx, "GET", prev, headers, scope)
    if owner is None:
        return answer or not_found(prev, "previous_response_id").response()
    return Pin({r.replica_id for r in ctx.registry if r.replica_id != owner})


def lookup_route(ctx: RouterContext, method: str,
                 headers_of: Callable[[web.Request], Mapping[str, str]]
                 ) -> Callable[[web.Request], Awaitable[web.Response]]:
    """GET or DELETE /v1/responses/{id}: the holder's answer."""

    async def handle(request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        _, answer = await ask(ctx, method, rid, headers_of(request), request["scope"])
        if answer is None:
            raise not_found(rid, "response_id")
        return answer

    return handle
