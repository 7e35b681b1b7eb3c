"""Middlewares every small listener needs (an admin or internal app): errors in OpenAI's shape
with a request ID on every answer, and a bearer key in front of every route.

    app = web.Application(middlewares=[answer_errors, require_bearer(key, "invalid admin key")])
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from batcher.http.errors import ApiError, from_http_exception
from batcher.http.keys import bearer_matches
from batcher.http.request_ids import new_request_id

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


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
