"""Stored responses behind a router: which replica holds `previous_response_id`, and GET and
DELETE of `/v1/responses/{id}`.

A stored response lives on the replica that made it. The router keeps nothing (it stays soft
state: a restarted router, or several side by side, find the same responses): it asks the
routable replicas, in parallel and with the caller's own key, and the one that answers 200
holds it (draining or not); its 200 ends the lookup and the other questions are cancelled,
so a hung replica delays nobody. A continuation (`previous_response_id`) is then routed to that
replica only (a 503 + Retry-After while it drains); a replica answers only for the caller's
tenant, so another tenant's id is a 404 as on a replica.
The cost is one small request per replica for each continued turn or lookup.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web

from batcher.fleet.context import RouterContext
from batcher.http.errors import ApiError

LOOKUP_TIMEOUT_S = 5.0


def not_found(rid: str, param: str) -> ApiError:
    return ApiError(404, f"no response '{rid}' is stored for this key on any routable replica",
                    param=param, code="response_not_found")


async def ask(ctx: RouterContext, method: str, rid: str, headers: Mapping[str, str]
              ) -> tuple[str | None, web.Response | None]:
    """(the id of the replica holding response `rid`, its answer to `method` there); when none
    holds it, (None, the first answer that was neither 200 nor 404, or a 503 when a replica did
    not answer), or (None, None) when every replica said 404."""
    # Trusted, draining or not: a draining replica still holds its responses.
    reps = [r for r in ctx.registry if ctx.registry.trusted(r)]
    path = "/v1/responses/" + urllib.parse.quote(rid, safe="", errors="surrogateescape")

    async def one(url: str) -> tuple[int, bytes, str]:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with ctx.session.request(
                    method, url + path, headers=headers,
                    timeout=aiohttp.ClientTimeout(total=LOOKUP_TIMEOUT_S)) as resp:
                return resp.status, await resp.read(), resp.content_type
        return 0, b"", ""

    # The holder's 200 answers at once: a replica that hangs delays nobody once it came.
    tasks = {asyncio.ensure_future(one(r.url)): r for r in reps}
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
    return None, other


async def pin_previous(ctx: RouterContext, body: dict[str, Any],
                       headers: Mapping[str, str]) -> set[str] | web.Response:
    """The replicas a request must not go to: every one but the holder of its
    `previous_response_id` (none without one). When no replica holds it: a 404, or the
    replicas' own refusal (a bad key is a 401 as on a replica)."""
    prev = body.get("previous_response_id")
    if not isinstance(prev, str) or not prev:
        return set()  # the replica validates it
    owner, answer = await ask(ctx, "GET", prev, headers)
    if owner is None:
        return answer or not_found(prev, "previous_response_id").response()
    return {r.replica_id for r in ctx.registry if r.replica_id != owner}


def lookup_route(ctx: RouterContext, method: str,
                 headers_of: Callable[[web.Request], Mapping[str, str]]
                 ) -> Callable[[web.Request], Awaitable[web.Response]]:
    """GET or DELETE /v1/responses/{id}: the holder's answer."""

    async def handle(request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        _, answer = await ask(ctx, method, rid, headers_of(request))
        if answer is None:
            raise not_found(rid, "response_id")
        return answer

    return handle
