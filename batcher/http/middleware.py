"""Middlewares every listener needs: errors in OpenAI's shape with a request ID on every answer
(`answer_errors` for a small listener, an admin or internal app; `api_middleware` for the public
API of replica and router alike, with the client's request ID, the body limit, the caller's key
and an access line for every refusal), and a bearer key in front of every route.

    app = web.Application(middlewares=[answer_errors, require_bearer(key, "invalid admin key")])
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from batcher.telemetry.access_log import LOGGED, log_refusal
from batcher.http.anthropic_errors import reshape_error
from batcher.http.errors import ApiError, from_http_exception
from batcher.http.held_answers import HeldAnswers
from batcher.http.keys import OPEN_PATHS, AuthError, bearer_matches
from batcher.http.listener import NO_ROUTE
from batcher.http.request_ids import HEADER, client_request_id, new_request_id
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


def error_code_of(resp: web.StreamResponse) -> str | None:
    """The code of an error answer another server made (a router relays a replica's): its
    `X-Reject-Reason`, else its body's `error.code` (OpenAI's shape); None below 400, or when it
    names none (Anthropic's shape carries no code)."""
    if resp.status < 400:
        return None
    code: object = resp.headers.get("X-Reject-Reason")
    if not code and isinstance(resp, web.Response) and isinstance(resp.body, bytes):
        try:
            err = orjson.loads(resp.body).get("error")
        except (orjson.JSONDecodeError, AttributeError):
            return None
        code = err.get("code") if isinstance(err, dict) else None
    # Another process's word: bounded and escaped like anything else a line echoes.
    return excerpt(code, 64) if isinstance(code, str) and code else None


def matched_route(request: web.Request) -> str | None:
    """The pattern of the app's route that matched (`/v1/requests/{id}`: the ids in a path are
    the caller's), or None for an unknown path or method."""
    route = request.match_info.route
    if route.resource is not None and route.name != NO_ROUTE:
        return route.resource.canonical
    return None


def route_of(request: web.Request) -> str:
    """The route as logged: a matched route's pattern (every id its own line would make the
    field unbounded), else the path itself, cut short (an unknown route is what the operator
    needs to see)."""
    return matched_route(request) or excerpt(request.rel_url.raw_path, 200)


# The route label of an unknown path or method: a label per path would let any client add a
# series to /metrics.
OTHER_ROUTE = "other"


def count_requests(observe: Callable[[str, str], None]) -> Middleware:
    """`observe(route, status)` once per request, after its answer: the matched route's pattern
    (else `OTHER_ROUTE`) and the status sent, as strings; `499` when the client went away before
    the handler finished (aiohttp cancelled it), `500` for an exception no inner middleware
    answered. Outermost, so refusals by the inner middlewares (401, 413) count too."""

    @web.middleware
    async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
        status = 499
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        except Exception:
            status = 500
            raise
        finally:
            observe(matched_route(request) or OTHER_ROUTE, str(status))

    return count


def error_answer(request: web.Request, exc: Exception, rid: str) -> tuple[web.Response,
                                                                        str | None]:
    """The answer to an exception out of a handler, with its error code: an `ApiError` as it
    says, aiohttp's own 4xx/5xx (unknown route, wrong method) in OpenAI's shape, anything else
    as `answer_unexpected` says. Re-raises aiohttp's redirects and other answers below 400."""
    if isinstance(exc, ApiError):
        return exc.response(rid), exc.code
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        err = from_http_exception(exc)
        return err.response(rid), err.code
    return answer_unexpected(request, exc, rid), None


@web.middleware
async def answer_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A fresh `X-Request-Id` on every answer; `ApiError` and aiohttp's own 4xx/5xx (unknown
    route, wrong method) answered in OpenAI's shape."""
    rid = new_request_id()
    try:
        resp = await handler(request)
    except Exception as exc:  # noqa: BLE001 (answered in OpenAI's shape, logged)
        return error_answer(request, exc, rid)[0]
    if not resp.prepared:
        resp.headers[HEADER] = rid
    return resp


def api_middleware(*, body_limit: Callable[[web.Request], int],
                   authenticate: Callable[[web.Request], None],
                   caller: Callable[[web.Request], str],
                   restamp_request_id: bool) -> Middleware:
    """The public API's middleware, replica and router alike: the request ID (the client's
    `X-Request-Id` when it sends one, a 400 when malformed, else a fresh one) in
    `request["request_id"]` and on every answer not yet sent; a body over `body_limit(request)`
    refused (413) before it is read; `authenticate(request)` on every route but `OPEN_PATHS`
    (it stores the caller where the handlers look; an `AuthError` is a 401); errors in OpenAI's
    shape (Anthropic's on the Messages paths), each with the access line no handler wrote,
    under `caller(request)`.

    `restamp_request_id`: the request ID replaces one a handler's answer carries (a replica's
    answers are its own), or leaves it (the router relays a replica's answer as it came).

    An `ApiError` with `hold_s` is held that long before it is sent, a bounded number at once
    (`batcher.http.held_answers`)."""
    held = HeldAnswers()

    @web.middleware
    async def api(request: web.Request, handler: Handler) -> web.StreamResponse:
        rid = new_request_id()
        try:
            rid = client_request_id(request.headers.get(HEADER)) or rid
            request["request_id"] = rid
            length = request.content_length
            limit = body_limit(request)
            if length is not None and length > limit:
                raise ApiError(413, f"the request body is {length} bytes; the limit is {limit}",
                               code="body_too_large")
            if request.path not in OPEN_PATHS:
                try:
                    authenticate(request)
                except AuthError as exc:
                    raise ApiError(401, str(exc), code="invalid_api_key") from None
            resp = await handler(request)
        except Exception as exc:  # noqa: BLE001 (answered in OpenAI's shape, logged)
            resp, code = error_answer(request, exc, rid)
            log_error_answer(request, rid, resp.status, code, caller(request))
            if isinstance(exc, ApiError) and exc.hold_s > 0:
                await held.hold(exc.hold_s)
        resp = reshape_error(request, resp)  # Anthropic's clients read Anthropic's shape
        if not resp.prepared and (restamp_request_id or HEADER not in resp.headers):
            resp.headers[HEADER] = rid
        return resp

    return api


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
