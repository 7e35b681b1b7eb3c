"""The router's public app: the same API as a replica, so clients cannot tell them apart.

Forwards `/v1/completions`, `/v1/chat/completions` and `/v1/embeddings` (see `forward.py`),
`POST /v1/probe` to a routable replica and `DELETE /v1/requests/{id}` to the replica running that
id; aggregates `/v1/models`, `/health` (the router answers), `/ready` (some replica can take
work), `/v1/state` (sums over routable replicas, plus a `replicas` list); serves its own
`/metrics`; takes heartbeats on `POST /internal/heartbeat` (with `Authorization: Bearer
FLEET_KEY` when the router has a fleet key). Every response carries `X-Request-Id`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from batcher.fleet.context import RouterContext
from batcher.fleet.forward import PASS_HEADERS, Relay, error_response, request_id
from batcher.fleet.health import HealthChecker

ROUTER = web.AppKey("router", RouterContext)


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload),
                        content_type="application/json")


@web.middleware
async def middleware(request: web.Request, handler: Callable[[web.Request],
                     Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    rid = request_id(request)
    request["request_id"] = rid
    try:
        resp = await handler(request)
    except web.HTTPRequestEntityTooLarge:
        return error_response(413, "the request body is too large", "body_too_large", rid)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason or "error", exc.reason, rid)
    if not resp.prepared and "X-Request-Id" not in resp.headers:
        resp.headers["X-Request-Id"] = rid
    return resp


def generation(chat: bool) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        ctx = request.app[ROUTER]
        rid = request["request_id"]
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return error_response(400, f"the body is not valid JSON: {exc}", "invalid_json", rid)
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object",
                                  "invalid_type", rid)
        relay = Relay(ctx, request, chat, body, raw, rid)
        ctx.inflight += 1
        ctx.metrics.inflight.inc()
        ctx.budget.note_request(ctx.clock())
        outcome = "cancelled"
        try:
            if body.get("stream") is True:
                resp = await relay.stream()
            else:
                resp = await relay.whole()
            outcome = relay.outcome(resp)
            return resp
        finally:
            ctx.cancelled.discard(rid)
            ctx.inflight -= 1
            ctx.metrics.inflight.dec()
            ctx.metrics.client_requests.labels(outcome).inc()

    return handle


async def heartbeat(request: web.Request) -> web.Response:
    ctx = request.app[ROUTER]
    key = ctx.cfg.fleet_key
    if key and not hmac.compare_digest(request.headers.get("Authorization", "").encode(),
                                       f"Bearer {key}".encode()):
        return error_response(401, "invalid fleet key", "invalid_api_key")
    try:
        payload = orjson.loads(await request.read())
        if not isinstance(payload, dict):
            raise TypeError("a heartbeat is a JSON object")
        accepted = ctx.registry.beat(payload, ctx.clock())
    except (orjson.JSONDecodeError, ValueError, TypeError) as exc:
        return error_response(400, str(exc), "invalid_heartbeat")
    return json_response({"accepted": accepted})


async def health(request: web.Request) -> web.Response:
    reg = request.app[ROUTER].registry
    return json_response({"status": "ok", "replicas": len(reg),
                          "routable": sum(1 for r in reg if reg.routable(r))})


async def ready(request: web.Request) -> web.Response:
    reg = request.app[ROUTER].registry
    ok = any(reg.routable(r) for r in reg)
    return json_response({"ready": ok, "reason": "ready" if ok else "no routable replica"},
                         200 if ok else 503)


async def state(request: web.Request) -> web.Response:
    ctx = request.app[ROUTER]
    reg = ctx.registry
    live = [r.state for r in reg if reg.routable(r) and r.state is not None]
    versions = sorted({s.version for s in live})
    return json_response({
        "free_blocks": sum(s.free_blocks for s in live),
        "total_blocks": sum(s.total_blocks for s in live),
        "block_size": min((s.block_size for s in live), default=16),
        "running": sum(s.running for s in live), "waiting": sum(s.waiting for s in live),
        "version": ",".join(versions), "draining": False, "healthy": bool(live),
        "in_flight": ctx.inflight, "router": True, "weights": ctx.rollout.weights,
        "replicas": reg.snapshot(ctx.clock())})


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
    ctx = request.app[ROUTER]
    reps = [r for r in ctx.registry if ctx.registry.routable(r)]

    async def one(url: str) -> list[dict[str, Any]]:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with ctx.session.get(url + "/v1/models", headers=_auth(request),
                                       timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                if resp.status == 200:
                    return list(orjson.loads(await resp.read()).get("data") or [])
        return []

    merged: dict[str, dict[str, Any]] = {}
    for items in await asyncio.gather(*(one(r.url) for r in reps)):
        for m in items:
            if isinstance(m, dict) and isinstance(m.get("id"), str):
                merged.setdefault(m["id"], m)
    return json_response({"object": "list", "data": list(merged.values())})


def _auth(request: web.Request) -> dict[str, str]:
    return {k: v for k in PASS_HEADERS if (v := request.headers.get(k)) is not None}


async def probe(request: web.Request) -> web.StreamResponse:
    ctx = request.app[ROUTER]
    rep = ctx.pick(1, None, set())
    if rep is None:
        return error_response(503, "no replica is ready", "no_replica", retry_after=1)
    try:
        async with ctx.session.post(f"{rep.url}/v1/probe?{request.query_string}",
                                    timeout=aiohttp.ClientTimeout(total=65.0)) as resp:
            body = await resp.read()
            return web.Response(status=resp.status, body=body, content_type=resp.content_type)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return error_response(503, f"the probe failed: {type(exc).__name__}", "probe_failed")


async def cancel(request: web.Request) -> web.StreamResponse:
    ctx = request.app[ROUTER]
    rid = request.match_info["id"]
    owner = ctx.registry.get(ctx.owners.get(rid, ""))
    if owner is None:
        return error_response(404, f"no request '{rid}' in flight", "request_not_found")
    try:
        async with ctx.session.delete(f"{owner.url}/v1/requests/{rid}", headers=_auth(request),
                                      timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
            if resp.status == 200 and rid in ctx.owners:
                ctx.cancelled.add(rid)  # its error is the answer, not a reason to fail over
            return web.Response(status=resp.status, body=await resp.read(),
                                content_type=resp.content_type)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return error_response(503, f"the cancel failed: {type(exc).__name__}", "cancel_failed")


def create_router_app(ctx: RouterContext) -> web.Application:
    """The public app. Its cleanup context owns the upstream session and the health checker."""
    app = web.Application(middlewares=[middleware], client_max_size=ctx.cfg.max_body_bytes)
    app[ROUTER] = ctx

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        cfg = ctx.cfg
        ctx.session = aiohttp.ClientSession(
            # NOTE: below the replicas' 20 s idle cut-off, so a pooled connection is never
            # reused just as the replica closes it.
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=10.0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout))
        ctx.health = HealthChecker(ctx.registry, cfg.health, ctx.session, ctx.on_evict,
                                   ctx.on_readmit, ctx.stalled, ctx.clock)
        ctx.health.start()
        yield
        await ctx.health.close()
        await ctx.session.close()

    app.cleanup_ctx.append(lifetime)
    app.router.add_post("/v1/completions", generation(chat=False))
    app.router.add_post("/v1/chat/completions", generation(chat=True))
    app.router.add_post("/v1/embeddings", generation(chat=False))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/v1/state", state)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/probe", probe)
    app.router.add_delete("/v1/requests/{id}", cancel)
    app.router.add_post("/internal/heartbeat", heartbeat)
    return app
