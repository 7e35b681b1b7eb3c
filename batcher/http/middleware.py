"""Middlewares every small listener needs (an admin or internal app): errors in OpenAI's shape
with a request ID on every answer, and a bearer key in front of every route.

    app = web.Application(middlewares=[answer_errors, require_bearer(key, "invalid admin key")])
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from batcher.access_log import LOGGED, log_refusal
from batcher.http.errors import ApiError, from_http_exception
from batcher.http.keys import bearer_matches
from batcher.http.listener import NO_ROUTE
from batcher.http.request_ids import new_request_id
from batcher.http.text import excerpt

log = logging.getLogger("batcher.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


def answer_unexpected(request: web.Request, exc: Exception, rid: str) -> web.Response:
    """The answer to an exception no handler turned into an `ApiError`, in OpenAI's shape with
    the request ID (aiohttp's own is a plain-text 500). What a client can cause deep inside
    parsing (a document nested past the interpreter's stack, a multipart body that breaks the
    HTTP parser) is a 400 and one log line; anything else is a 500 logged with its traceback.
    Re-raises when the response has already started (aiohttp then drops the connection)."""
    if request.writer is not None and request.writer.output_size > 0:
        raise exc
    if isinstance(exc, ConnectionError):  # the client went away: nobody reads the answer
        log.info("request %s to %s: the client closed the connection", rid, request.path)
        return ApiError(400, "the connection was closed", code="connection_closed").response(rid)
    if isinstance(exc, RecursionError | HttpProcessingError):
        log.info("request %s to %s refused: %s", rid, request.path, type(exc).__name__)
        return ApiError(400, "the request is nested too deeply or malformed",
                        code="invalid_request").response(rid)
    log.error("request %s to %s failed", rid, request.path, exc_info=exc)
    # The same request would fail the same way again: tell clients and routers not to retry.
    return ApiError(500, "internal error; the request id identifies it in the server's log",
                    code="internal_error", headers={"x-should-retry": "false"}).response(rid)


def log_error_answer(request: web.Request, rid: str, status: int, code: str | None,
                     tenant: str) -> None:
    """The access line of an error answer no handler logged itself (a key refused, an unknown
    route, a body too large or malformed): why, where an operator looks. Replica and router."""
    if request.get(LOGGED):
        return
    log_refusal(request_id=rid, tenant=tenant, route=route_of(request), status=status,
                error_code=code)


def route_of(request: web.Request) -> str:
    """The route as logged: a matched route's pattern (`/v1/requests/{id}`: the ids in
    a path are the caller's, and every id its own line would make the field unbounded), else the
    path itself, cut short (an unknown route is what the operator needs to see)."""
    route = request.match_info.route
    if route.resource is not None and route.name != NO_ROUTE:
        return route.resource.canonical
    return excerpt(request.rel_url.raw_path, 200)


@web.middleware
async def answer_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A fresh `X-Request-Id` on every answer; `ApiError` and aiohttp's own 4xx/5xx (unknown
    route, wrong method) answered in OpenAI's shape."""
    rid = new_request_id()
    try:
        resp = await handler(request)
    except ApiError as err:
        return err.response(rid)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return from_http_exception(exc).response(rid)
    except Exception as exc:  # noqa: BLE001 (answered in OpenAI's shape, logged)
        return answer_unexpected(request, exc, rid)
    if not resp.prepared:
        resp.headers["X-Request-Id"] = rid
    return resp


def require_bearer(key: str, message: str) -> Middleware:
    """Every route needs `Authorization: Bearer <key>` (checked in constant time); anything else
    is a 401 with `message`, which must not say more than that the key is wrong."""
    if not key:
        raise ValueError("a keyed listener needs a non-empty key")

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not bearer_matches(request.headers, key):
            raise ApiError(401, message, code="invalid_api_key")
        return await handler(request)

    return check
