"""`GET /v1/files` and `GET /v1/batches` through the router: every trusted replica asked for
the caller's page, the answers merged in order (`batch_ids.merge`), `"partial": true` when a
replica that may hold some of them was left out."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from batcher.fleet.router import batch_ids
from batcher.fleet.router.batch_replicas import (
    KINDS,
    PROXY,
    Unreachable,
    call_headers,
    error_code,
    owner,
    passed_error,
    passed_on,
    quoted,
    unavailable,
)
from batcher.fleet.router.registry import Replica
from batcher.http.errors import ApiError, invalid
from batcher.http.list_query import list_limit
from batcher.http.responses import json_response


async def _list(request: web.Request, kind: str) -> web.Response:
    proxy = request.app[PROXY]
    q = request.query
    limit = list_limit(q)
    order = q.get("order", "desc") if kind == "file" else "desc"
    if order not in ("asc", "desc"):
        raise invalid("'order' must be 'asc' or 'desc'", "order")
    base: dict[str, str] = {"limit": str(limit)}
    if kind == "file":
        base["order"] = order
        if "purpose" in q:
            base["purpose"] = q["purpose"]
    headers = call_headers(request)
    cursor = None
    if "after" in q:
        cursor = await _cursor(request, kind, q["after"], headers)
    path = KINDS[kind][2]
    reg = proxy.ctx.registry
    # A tenant's key goes only to replicas the router trusts; one it does not (registered by a
    # beat but never reached, evicted) may hold objects of the caller's, so the list says so.
    reps = [r for r in reg if reg.trusted(r)]
    partial = len(reps) < len(reg)
    if not reps:
        raise ApiError(503, "no replica is ready to list from", code="no_replica",
                       retry_after=2)

    async def ask(rep: Replica) -> tuple[int, Any]:
        query = {**base, **batch_ids.page_query(cursor, rep.replica_id, order == "asc")}
        return await proxy.call(rep, "GET", path, headers, query)

    answers = await asyncio.gather(*(ask(r) for r in reps), return_exceptions=True)
    pages: dict[str, tuple[list[dict[str, Any]], bool]] = {}
    disabled = unreachable = 0
    for rep, ans in zip(reps, answers, strict=True):
        if isinstance(ans, BaseException):
            if isinstance(ans, Unreachable):
                # What the others hold is still an answer; `partial` says it may lack some.
                unreachable += 1
                continue
            raise ans
        status, body = ans
        if status == 404 and error_code(body) == "batch_api_disabled":
            disabled += 1
            continue
        if status != 200 or not isinstance(body, dict):
            return passed_on(status, body)
        items = [batch_ids.outward(x, rep.replica_id) for x in body.get("data") or ()
                 if isinstance(x, dict)]
        pages[rep.replica_id] = (items, bool(body.get("has_more")))
    if not pages and unreachable:
        raise ApiError(503, f"no replica holding {kind}s answered; retry later",
                       code="replica_unavailable", retry_after=2)
    if not pages:
        raise ApiError(404, "no replica behind this router serves the batch API",
                       code="batch_api_disabled")
    page = batch_ids.merge(pages, limit, order == "asc")
    if partial or unreachable:
        page["partial"] = True  # an addition to OpenAI's list shape; absent when complete
    return json_response(page)


async def _cursor(request: web.Request, kind: str, after: str, headers: dict[str, str]
                  ) -> batch_ids.Cursor:
    """Where the page continues; 400 when `after` names nothing of the caller's (as a
    replica answers)."""
    proxy = request.app[PROXY]
    try:
        rep, inner = owner(request, kind, after, "after")
        status, body = await proxy.call(rep, "GET", f"{KINDS[kind][2]}/{quoted(inner)}",
                                        headers)
    except Unreachable:
        raise unavailable(f"{kind} {after!r}") from None
    except ApiError as err:
        if err.status == 503:  # its replica is not trusted now
            raise
        status, body = 404, None
    if status in (401, 403):
        raise passed_error(status, body)
    created = body.get("created_at") if isinstance(body, dict) else None
    if status != 200 or not isinstance(created, int | float):
        raise invalid(f"'after' names no {kind} of yours: {after!r}", "after")
    return batch_ids.Cursor(inner, rep.replica_id, int(created))


async def list_files(request: web.Request) -> web.Response:
    return await _list(request, "file")


async def list_batches(request: web.Request) -> web.Response:
    return await _list(request, "batch")
