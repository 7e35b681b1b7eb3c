"""The router's public app: the same API as a replica, so clients cannot tell them apart.

Forwards `/v1/completions`, `/v1/chat/completions`, `/v1/embeddings`, `/v1/responses` and
`/v1/messages` (see `forward.py`; stored responses: `responses_proxy.py`) and
`DELETE /v1/requests/{id}` to the replica running that id for that caller, and the batch API
(`/v1/files`, `/v1/batches`: `batch_proxy.py`) to the replica holding each object; aggregates
`/v1/models` (with the caller's key, so a bad key is a 401 as on a replica), `/health` (the
router answers), `/ready` (some replica can take work), `/v1/state` (sums over routable
replicas; no replica addresses); serves its own `/metrics`. `POST /v1/probe` needs the router's
admin or fleet key and answers from the health checker's own probes: client probes never reach
a replica. Heartbeats are on the internal listener (`internal.py`), drain and canary on the
admin listener (`admin.py`). Every response carries `X-Request-Id`; malformed input gets the
replica's answer (one toolkit, `batcher.http`), never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from batcher.fleet.router.batch_proxy import add_batch_routes
from batcher.fleet.router.cell_state import CellCollector, StateHeader, aggregate
from batcher.fleet.router.context import RouterContext
from batcher.fleet.router.forward import PASS_HEADERS, Relay
from batcher.fleet.router.health import HealthChecker
from batcher.fleet.router.responses_proxy import lookup_route, pin_previous
from batcher.fleet.router.scope import tenant_scope
from batcher.fleet.router.stream_relay import StreamRelay
from batcher.http.errors import ApiError
from batcher.http.keys import bearer_matches
from batcher.http.listener import add_fallback_route, expect_continue, read_body, read_json
from batcher.http.middleware import (
    api_middleware,
    count_requests,
    error_code_of,
    log_error_answer,
)
from batcher.http.responses import json_response
from batcher.http.upstream import UpstreamPool
from batcher.telemetry.access_log import LOGGED

log = logging.getLogger("batcher.fleet.proxy")

ROUTER = web.AppKey("router", RouterContext)
STATE_HEADER = web.AppKey("state_header", StateHeader)
# Idle pooled connections to replicas close after this: below the replicas' 20 s idle cut-off,
# so a connection is never reused just as its replica closes it.
KEEPALIVE_S = 10.0
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings",
                              "/v1/responses", "/v1/messages"})


def body_limit(request: web.Request) -> int:
    cfg = request.app[ROUTER].cfg
    # A file upload streams to a replica under its own limit (batch_proxy.py).
    return cfg.max_upload_bytes if request.path == "/v1/files" else cfg.max_body_bytes


def authenticate(request: web.Request) -> None:
    request["scope"] = tenant_scope(request.headers)


def caller_scope(request: web.Request) -> str:
    return request.get("scope", "-")


# Request ID, body limit, the caller's scope, errors in OpenAI's shape: as a replica's, but an
# answer relayed from a replica keeps the X-Request-Id it came with.
middleware = api_middleware(body_limit=body_limit, authenticate=authenticate,
                            caller=caller_scope, restamp_request_id=False)


def generation(chat: bool, pinned: bool = False
               ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """`pinned`: a continuation of a stored response goes to the replica holding it."""

    async def handle(request: web.Request) -> web.StreamResponse:
        ctx = request.app[ROUTER]
        rid = request["request_id"]
        raw = await read_body(request)
        body = await read_json(request, raw)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_type")
        relay = (StreamRelay if body.get("stream") is True else Relay)(
            ctx, request, chat, body, raw, rid, request["scope"])
        if pinned:
            pin = await pin_previous(ctx, body, _auth(request), request["scope"])
            if isinstance(pin, web.Response):
                return pin
            relay.tried |= pin.elsewhere
            if pin.inner is not None:  # the holder's own id for it
                relay.set_body(dict(body, previous_response_id=pin.inner))
        ctx.inflight += 1  # the gauge reads it at scrape time
        ctx.budget.note_request(ctx.clock(), request["scope"])
        outcome = "cancelled"
        try:
            if isinstance(relay, StreamRelay):
                resp = await relay.stream()
            else:
                resp = await relay.whole()
            outcome = relay.outcome(resp)
            return resp
        finally:
            ctx.cancelled.discard(relay.rkey)
            ctx.inflight -= 1
            ctx.later(ctx.metrics.client_request, outcome)

    return handle


async def health(request: web.Request) -> web.Response:
    reg = request.app[ROUTER].registry
    return json_response({"status": "ok", "replicas": len(reg),
                          "routable": sum(1 for r in reg if reg.routable(r))})


async def ready(request: web.Request) -> web.Response:
    reg = request.app[ROUTER].registry
    ok = any(reg.routable(r) for r in reg)
    return json_response({"ready": ok, "reason": "ready" if ok else "no routable replica"},
                         status=200 if ok else 503)


async def state(request: web.Request) -> web.Response:
    """Capacity summed over routable replicas, with the cell's saturation (`cell_state.py`).
    Anyone may read it, so it names no replica address (the admin listener's /admin/status
    does)."""
    return json_response(aggregate(request.app[ROUTER]))


async def state_header(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer to a forwarded request carries the cell's aggregate state, as a replica's
    carries its own: a balancer in front learns it from traffic as well as from polls."""
    if request.path in GENERATION_PATHS and STATE_HEADER in request.app:
        response.headers["X-Replica-State"] = request.app[STATE_HEADER].value()


async def metrics(request: web.Request) -> web.Response:
    ctx = request.app[ROUTER]
    reg, now = ctx.registry, ctx.clock()
    views = {"routable": 0, "evicted": 0, "suspect": 0, "draining": 0}
    for r in reg:
        views["routable"] += reg.routable(r)
        views["evicted"] += r.evicted
        views["suspect"] += reg.suspect(r, now)
        views["draining"] += r.router_draining or bool(r.state and r.state.draining)
    for view, count in views.items():
        ctx.metrics.replicas.labels(view).set(count)
    return web.Response(body=ctx.metrics.exposition(),
                        headers={"Content-Type": "text/plain; version=0.0.4"})


async def models(request: web.Request) -> web.Response:
    """The union of the routable replicas' models, asked with the caller's key: when no replica
    answers 200, the caller gets the first refusal (a bad key is a 401, as on a replica)."""
    ctx = request.app[ROUTER]
    reps = [r for r in ctx.registry if ctx.registry.routable(r)]

    async def one(url: str) -> tuple[int, bytes]:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with ctx.session.get(url + "/v1/models", headers=_auth(request),
                                       timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                return resp.status, await resp.read()
        return 0, b""

    merged: dict[str, dict[str, Any]] = {}
    refusal: tuple[int, bytes] | None = None
    for status, raw in await asyncio.gather(*(one(r.url) for r in reps)):
        if status != 200:
            if 400 <= status < 500 and refusal is None:
                refusal = (status, raw)
            continue
        with contextlib.suppress(orjson.JSONDecodeError, AttributeError, TypeError):
            for m in orjson.loads(raw).get("data") or ():
                if isinstance(m, dict) and isinstance(m.get("id"), str):
                    merged.setdefault(m["id"], m)
    if not merged and refusal is not None:
        return relayed_refusal(request, web.Response(status=refusal[0], body=refusal[1],
                                                     content_type="application/json"))
    if not reps:
        raise ApiError(503, "no replica is ready to serve", code="no_replica", retry_after=1)
    return json_response({"object": "list", "data": list(merged.values())})


def relayed_refusal(request: web.Request, resp: web.Response) -> web.Response:
    """A replica's answer relayed as it came; an error among them gets the access line the
    middleware writes for the router's own, with the replica's error code."""
    if resp.status >= 400:
        log_error_answer(request, request["request_id"], resp.status, error_code_of(resp),
                         caller_scope(request))
        request[LOGGED] = True
    return resp


def _auth(request: web.Request) -> dict[str, str]:
    return {k: v for k in PASS_HEADERS if (v := request.headers.get(k)) is not None}


async def probe(request: web.Request) -> web.Response:
    """The health checker's latest deep probes, for an operator (admin or fleet key). Nothing is
    sent upstream: the router probes replicas on its own schedule."""
    ctx = request.app[ROUTER]
    keys = [k for k in (ctx.cfg.admin_key, ctx.cfg.fleet_key) if k]
    # Every key is compared, so the time taken does not say which one matched.
    if not sum(bearer_matches(request.headers, k) for k in keys):
        raise ApiError(401, "the probe needs the router's admin or fleet key",
                       code="invalid_api_key")
    records = ctx.health.records if ctx.health is not None else {}
    reg = ctx.registry
    passing = [r.replica_id for r in reg if reg.routable(r)
               and ((rec := records.get(r.replica_id)) is None or rec.last_probe_ok is not False)]
    body = {"ok": bool(passing), "routable": sum(1 for r in reg if reg.routable(r)),
            "passing": len(passing)}
    return json_response(body, status=200 if passing else 503)


async def cancel(request: web.Request) -> web.StreamResponse:
    """Cancel the caller's own request. An id the caller does not own is asked of a replica
    with the caller's key, so the answer (401 for a bad key, else 404) is the replica's and says
    nothing about other callers' ids."""
    ctx = request.app[ROUTER]
    rid = request.match_info["id"]
    rkey = (request["scope"], rid)
    owner = ctx.registry.get(ctx.owners.get(rkey, ""))
    if owner is None:
        owner = next((r for r in ctx.registry if ctx.registry.routable(r)), None)
        if owner is None:
            raise ApiError(404, f"no request '{rid}' in flight", param="id",
                           code="request_not_found")
    try:
        path = "/v1/requests/" + urllib.parse.quote(rid, safe="", errors="surrogateescape")
        async with ctx.session.delete(owner.url + path, headers=_auth(request),
                                      timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
            if resp.status == 200 and rkey in ctx.owners:
                ctx.cancelled.add(rkey)  # its error is the answer, not a reason to fail over
            return relayed_refusal(request, web.Response(
                status=resp.status, body=await resp.read(), content_type=resp.content_type))
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ApiError(503, f"the cancel failed: {type(exc).__name__}", code="cancel_failed",
                       retry_after=1) from None


def create_router_app(ctx: RouterContext, cell_name: str | None = "local") -> web.Application:
    """The public app. Its cleanup context owns the upstream session and the health checker.
    `cell_name` labels the router's own `batcher_cell_saturation`; None exports none."""
    # Counted outermost, as on a replica: the middleware's own refusals count too.
    counted = count_requests(lambda route, status: ctx.later(ctx.metrics.request_by_route,
                                                             route, status))
    app = web.Application(middlewares=[counted, middleware],
                          client_max_size=ctx.cfg.max_body_bytes)
    app[ROUTER] = ctx
    app[STATE_HEADER] = StateHeader(ctx)
    if cell_name is not None:  # a balancer (cells as upstreams) exports its own per cell
        with contextlib.suppress(ValueError):  # registered already (this context's other app)
            ctx.metrics.registry.register(CellCollector(ctx, cell_name))

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        cfg = ctx.cfg
        ctx.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
            # Callers share the connections: no replica's cookie may follow another caller.
            cookie_jar=aiohttp.DummyCookieJar(),
            # Nothing the replicas read: not built or sent on every hop (no Accept-Encoding, so
            # a replica never compresses what the router relays).
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout))
        ctx.upstream = UpstreamPool(connect_timeout=cfg.connect_timeout,
                                    idle_timeout=KEEPALIVE_S)
        ctx.health = HealthChecker(ctx.registry, cfg.health, ctx.session, ctx.on_evict,
                                   ctx.on_readmit, ctx.stalled, ctx.clock,
                                   probe_key=cfg.replica_admin_key or cfg.fleet_key)
        ctx.health.start()
        yield
        await ctx.health.close()
        await ctx.session.close()
        await ctx.upstream.close()

    app.cleanup_ctx.append(lifetime)
    app.on_response_prepare.append(state_header)
    routes = [("POST", "/v1/completions", generation(chat=False)),
              ("POST", "/v1/chat/completions", generation(chat=True)),
              ("POST", "/v1/embeddings", generation(chat=False)),
              ("POST", "/tokenize", generation(chat=False)),
              ("POST", "/detokenize", generation(chat=False)),
              ("POST", "/v1/responses", generation(chat=True, pinned=True)),
              ("GET", "/v1/responses/{id}", lookup_route(ctx, "GET", _auth)),
              ("DELETE", "/v1/responses/{id}", lookup_route(ctx, "DELETE", _auth)),
              ("POST", "/v1/messages", generation(chat=True)),
              ("POST", "/v1/messages/count_tokens", generation(chat=True)),
              ("GET", "/v1/models", models), ("GET", "/health", health), ("GET", "/ready", ready),
              ("GET", "/v1/state", state), ("GET", "/metrics", metrics),
              ("POST", "/v1/probe", probe), ("DELETE", "/v1/requests/{id}", cancel)]
    for method, path, handler in routes:
        app.router.add_route(method, path, handler, expect_handler=expect_continue)
    add_batch_routes(app, ctx)
    add_fallback_route(app)
    return app
