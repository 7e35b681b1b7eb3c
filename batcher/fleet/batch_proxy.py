"""`/v1/files` and `/v1/batches` through the router.

A file is uploaded to the routable replica with the most headroom (fewest waiting requests, then
most free KV, then fewest running), or, with `--batch-pool`, to the pool's replica with the most
headroom; a batch is created where its input file is (its lines run on that replica's spare
capacity). Every later call on a file or batch goes to the replica its id names (`batch_ids.py`).
Lists merge the answers of every replica the router trusts (`Registry.trusted`: healthy, ready,
not evicted) for the caller. The router checks nothing about tenants: it passes the caller's key
on, to trusted replicas only, and each answers for that key's tenant only, exactly as when called
directly. A replica that cannot be reached is a 503 (OpenAI's error shape, Retry-After) for the
objects it holds; a list leaves it out and says `"partial": true` (as it does when a registered
replica is not trusted), so one replica down does not fail every tenant's listing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from batcher.fleet import batch_ids
from batcher.fleet.context import RouterContext
from batcher.fleet.forward import PASS_HEADERS
from batcher.fleet.registry import Registry, Replica
from batcher.http.errors import ApiError, invalid
from batcher.http.listener import expect_continue, read_body, read_json
from batcher.http.responses import json_response

CALL_TIMEOUT = aiohttp.ClientTimeout(total=10.0)
STREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_read=60.0)
# How long the router remembers whether a replica serves the batch API at all.
CAPABLE_TTL_S = 30.0
UPLOAD_CANDIDATES = 3
MAX_LIST_LIMIT = 100
_CHUNK = 1 << 16
# Object kind -> (path parameter, not-found code, collection path).
KINDS = {"file": ("file_id", "file_not_found", "/v1/files"),
         "batch": ("batch_id", "batch_not_found", "/v1/batches")}


class Unreachable(Exception):
    """The replica holding an object did not answer."""


class BatchProxy:
    """The routes' shared state: the router's context and which replicas serve the batch API."""

    def __init__(self, ctx: RouterContext):
        self.ctx = ctx
        self._capable: dict[str, tuple[bool, float]] = {}  # replica id -> (serves it, when)

    # choosing a replica for a new file ------------------------------------------------------
    def upload_order(self) -> list[Replica]:
        """Routable replicas (of the batch pool, when one is configured) by headroom."""
        pool = set(self.ctx.cfg.batch_pool)
        reg = self.ctx.registry
        reps = [r for r in reg if reg.routable(r) and (not pool or r.replica_id in pool)]

        rng = self.ctx.rng

        def pressure(r: Replica) -> tuple[int, float, int, float]:
            st = r.state
            assert st is not None  # routable
            # Equal replicas (idle ones, say) take turns at random rather than one taking all.
            return (Registry.effective_waiting(r),
                    -Registry.effective_free(r) / max(1, st.total_blocks), st.running,
                    rng.random())

        return sorted(reps, key=pressure)

    async def serves_batches(self, rep: Replica, headers: dict[str, str]) -> bool:
        """Whether the replica has the batch API on (remembered a while). A refusal of the
        caller's key is the caller's answer."""
        known = self._capable.get(rep.replica_id)
        if known is not None and time.monotonic() - known[1] < CAPABLE_TTL_S:
            return known[0]
        status, body = await self.call(rep, "GET", "/v1/files", headers, {"limit": "1"})
        if status in (401, 403):
            raise _passed_error(status, body)
        capable = status == 200
        if capable or _code(body) == "batch_api_disabled":
            self._capable[rep.replica_id] = (capable, time.monotonic())
        return capable

    # talking to replicas --------------------------------------------------------------------
    async def call(self, rep: Replica, method: str, path: str, headers: dict[str, str],
                   query: dict[str, str] | None = None, json: Any = None) -> tuple[int, Any]:
        """One whole JSON call; (status, parsed body). `Unreachable` when it did not answer."""
        assert self.ctx.session is not None
        try:
            async with self.ctx.session.request(method, rep.url + path, headers=headers,
                                                params=query, json=json,
                                                timeout=CALL_TIMEOUT) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Unreachable(f"{type(exc).__name__}") from None
        try:
            return status, orjson.loads(raw)
        except orjson.JSONDecodeError:
            if status >= 500:
                raise Unreachable(f"status {status}") from None
            return status, None


def _code(body: Any) -> str | None:
    err = body.get("error") if isinstance(body, dict) else None
    return err.get("code") if isinstance(err, dict) else None


def _passed(status: int, body: Any) -> web.Response:
    """A replica's refusal, passed on as it came (it is already in OpenAI's shape)."""
    if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
        body = {"error": {"message": f"the replica answered {status}", "type": "api_error",
                          "param": None, "code": None}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _unavailable(what: str) -> ApiError:
    return ApiError(503, f"the replica holding {what} is not reachable; retry later",
                    code="replica_unavailable", retry_after=2)


PROXY = web.AppKey("batch_proxy", BatchProxy)


def _headers(request: web.Request) -> dict[str, str]:
    h = {k: v for k in PASS_HEADERS if (v := request.headers.get(k)) is not None}
    h["X-Request-Id"] = request["request_id"]
    return h


def _owner(request: web.Request, kind: str, router_id: str | None = None,
           param: str | None = None) -> tuple[Replica, str]:
    """The replica holding the object an id names, and the replica's id for it; 404 (as a
    replica answers for an id that is not the caller's) when the router made no such id."""
    name, code, _ = KINDS[kind]
    router_id = router_id if router_id is not None else request.match_info[name]
    decoded = batch_ids.decode(router_id)
    rep = None if decoded is None else request.app[PROXY].ctx.registry.get(decoded[1])
    if decoded is None or rep is None:
        raise ApiError(404, f"no such {kind}: {router_id!r}", param=param or name, code=code)
    if not request.app[PROXY].ctx.registry.trusted(rep):
        # Registered but not (or no longer) reached and healthy: not sent a tenant's key.
        raise _unavailable(f"{kind} {router_id!r}")
    return rep, decoded[0]


def _quoted(inner: str) -> str:
    return urllib.parse.quote(inner, safe="")


async def _one(request: web.Request, kind: str, method: str, suffix: str = "",
               json: Any = None) -> web.Response:
    """Forward a call on one object to its replica; its JSON answer with router ids."""
    rep, inner = _owner(request, kind)
    proxy = request.app[PROXY]
    path = f"{KINDS[kind][2]}/{_quoted(inner)}{suffix}"
    try:
        status, body = await proxy.call(rep, method, path, _headers(request), json=json)
    except Unreachable:
        raise _unavailable(f"{kind} {request.match_info[KINDS[kind][0]]!r}") from None
    if status != 200:
        return _passed(status, body)
    return json_response(batch_ids.outward(body, rep.replica_id))


# files ---------------------------------------------------------------------------------------
async def upload_file(request: web.Request) -> web.StreamResponse:
    proxy = request.app[PROXY]
    limit = proxy.ctx.cfg.max_upload_bytes
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, f"the upload is {request.content_length} bytes; uploads are "
                       f"limited to {limit} bytes", code="file_too_large")
    if not request.content_type.startswith("multipart/"):
        raise invalid("upload a file as multipart/form-data with 'file' and 'purpose' fields",
                      None, "invalid_content_type")
    headers = _headers(request)
    target = None
    asked = proxy.upload_order()[:UPLOAD_CANDIDATES]
    disabled = 0  # candidates that said they have no batch API (not merely did not answer)
    for rep in asked:
        with contextlib.suppress(Unreachable):
            if await proxy.serves_batches(rep, headers):
                target = rep
                break
            disabled += proxy._capable.get(rep.replica_id, (True, 0.0))[0] is False
    if target is None:
        if asked and disabled == len(asked):
            raise ApiError(404, "no replica behind this router serves the batch API (start "
                           "replicas with --data-dir)", code="batch_api_disabled")
        raise ApiError(503, "no replica that serves the batch API is ready", code="no_replica",
                       retry_after=2)
    headers["Content-Type"] = request.headers["Content-Type"]
    if request.content_length is not None:
        headers["Content-Length"] = str(request.content_length)
    assert proxy.ctx.session is not None
    body_in = _Limited(request, limit)
    try:
        async with proxy.ctx.session.post(target.url + "/v1/files", headers=headers,
                                          data=body_in.chunks(),
                                          timeout=STREAM_TIMEOUT) as resp:
            raw = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError, _TooLarge):
        if body_in.too_large:
            raise _too_large(limit) from None
        raise ApiError(503, "the upload did not reach a replica; send it again",
                       code="replica_unavailable", retry_after=2) from None
    if body_in.too_large:
        raise _too_large(limit)
    body = _json(raw)
    if status != 200:
        return _passed(status, body)
    return json_response(batch_ids.outward(body, target.replica_id))


class _TooLarge(Exception):
    pass


class _Limited:
    """The request body, passed on as it arrives; an upload past `limit` is cut off there
    (whatever the replica then answers, the caller gets the 413)."""

    def __init__(self, request: web.Request, limit: int):
        self.request = request
        self.limit = limit
        self.too_large = False

    async def chunks(self) -> AsyncIterator[bytes]:
        size = 0
        while chunk := await self.request.content.read(_CHUNK):
            size += len(chunk)
            if size > self.limit:
                self.too_large = True
                raise _TooLarge
            yield chunk


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"uploads are limited to {limit} bytes", param="file",
                    code="file_too_large", headers={"Connection": "close"})


def _json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


async def get_file(request: web.Request) -> web.Response:
    return await _one(request, "file", "GET")


async def delete_file(request: web.Request) -> web.Response:
    return await _one(request, "file", "DELETE")


async def file_content(request: web.Request) -> web.StreamResponse:
    rep, inner = _owner(request, "file")
    ctx = request.app[PROXY].ctx
    assert ctx.session is not None
    url = f"{rep.url}/v1/files/{_quoted(inner)}/content"
    out: web.StreamResponse | None = None
    try:
        async with ctx.session.get(url, headers=_headers(request),
                                   timeout=STREAM_TIMEOUT) as resp:
            if resp.status != 200:
                return _passed(resp.status, _json(await resp.read()))
            out = web.StreamResponse(headers={
                "Content-Type": resp.headers.get("Content-Type", "application/jsonl"),
                "X-Request-Id": request["request_id"]})
            if resp.content_length is not None:
                out.content_length = resp.content_length
            await out.prepare(request)
            async for chunk in resp.content.iter_chunked(_CHUNK):
                await out.write(chunk)
            await out.write_eof()
            return out
    except (aiohttp.ClientError, TimeoutError):
        if out is not None and out.prepared:
            raise  # mid-download: the connection ends, the client sees a short body
        raise _unavailable(f"file {request.match_info['file_id']!r}") from None


# batches -------------------------------------------------------------------------------------
async def create_batch(request: web.Request) -> web.Response:
    body = await read_json(request, await read_body(request))
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise invalid("'input_file_id' is required", "input_file_id", "missing")
    rep, inner = _owner(request, "file", file_id, "input_file_id")
    proxy = request.app[PROXY]
    try:
        status, answer = await proxy.call(rep, "POST", "/v1/batches", _headers(request),
                                          json={**body, "input_file_id": inner})
    except Unreachable:
        raise _unavailable(f"file {file_id!r}") from None
    if status != 200:
        return _passed(status, answer)
    return json_response(batch_ids.outward(answer, rep.replica_id))


async def get_batch(request: web.Request) -> web.Response:
    return await _one(request, "batch", "GET")


async def cancel_batch(request: web.Request) -> web.Response:
    return await _one(request, "batch", "POST", "/cancel")


# lists ---------------------------------------------------------------------------------------
async def _list(request: web.Request, kind: str) -> web.Response:
    proxy = request.app[PROXY]
    q = request.query
    raw_limit = q.get("limit", "20")
    # isascii: str.isdigit() also takes digits int() refuses ('²'), which would be a 500.
    digits = raw_limit.isascii() and raw_limit.isdigit() and len(raw_limit) <= 6
    if not digits or not 1 <= int(raw_limit) <= MAX_LIST_LIMIT:
        raise invalid(f"'limit' must be an integer from 1 to {MAX_LIST_LIMIT}", "limit")
    limit = int(raw_limit)
    order = q.get("order", "desc") if kind == "file" else "desc"
    if order not in ("asc", "desc"):
        raise invalid("'order' must be 'asc' or 'desc'", "order")
    base: dict[str, str] = {"limit": str(limit)}
    if kind == "file":
        base["order"] = order
        if "purpose" in q:
            base["purpose"] = q["purpose"]
    headers = _headers(request)
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
        if status == 404 and _code(body) == "batch_api_disabled":
            disabled += 1
            continue
        if status != 200 or not isinstance(body, dict):
            return _passed(status, body)
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
        rep, inner = _owner(request, kind, after, "after")
        status, body = await proxy.call(rep, "GET", f"{KINDS[kind][2]}/{_quoted(inner)}",
                                        headers)
    except Unreachable:
        raise _unavailable(f"{kind} {after!r}") from None
    except ApiError as err:
        if err.status == 503:  # its replica is not trusted now
            raise
        status, body = 404, None
    if status in (401, 403):
        raise _passed_error(status, body)
    created = body.get("created_at") if isinstance(body, dict) else None
    if status != 200 or not isinstance(created, int | float):
        raise invalid(f"'after' names no {kind} of yours: {after!r}", "after")
    return batch_ids.Cursor(inner, rep.replica_id, int(created))


def _passed_error(status: int, body: Any) -> ApiError:
    err = body.get("error") if isinstance(body, dict) else None
    err = err if isinstance(err, dict) else {}
    return ApiError(status, str(err.get("message") or f"the replica answered {status}"),
                    param=err.get("param"), code=err.get("code"))


async def list_files(request: web.Request) -> web.Response:
    return await _list(request, "file")


async def list_batches(request: web.Request) -> web.Response:
    return await _list(request, "batch")


def add_batch_routes(app: web.Application, ctx: RouterContext) -> None:
    """The batch API on the router's public app (before its catch-all route)."""
    app[PROXY] = BatchProxy(ctx)
    for method, path, handler in (
            ("POST", "/v1/files", upload_file), ("GET", "/v1/files", list_files),
            ("GET", "/v1/files/{file_id}", get_file),
            ("DELETE", "/v1/files/{file_id}", delete_file),
            ("GET", "/v1/files/{file_id}/content", file_content),
            ("POST", "/v1/batches", create_batch), ("GET", "/v1/batches", list_batches),
            ("GET", "/v1/batches/{batch_id}", get_batch),
            ("POST", "/v1/batches/{batch_id}/cancel", cancel_batch)):
        app.router.add_route(method, path, handler, expect_handler=expect_continue)
