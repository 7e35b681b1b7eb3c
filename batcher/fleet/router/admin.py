"""The router's admin listener (own port, own key; never on the public port): status, drain and
undrain replicas, canary weights.

Contract:
- Every route needs `Authorization: Bearer ADMIN_KEY` (scheme in any case; checked by the shared
  toolkit, so odd header bytes are a 401, never a 500).
- Drain (`POST /admin/drain {"replica": id}`): the router stops routing to the replica at once,
  asks the replica's admin listener to drain (so other routers learn it from the next
  heartbeat), and reports `idle` once neither the router nor the replica holds any of its work.
  The replicas' admin key goes only to an admin URL the operator configured
  (`--replica URL,ADMIN_URL`) or the replica announced with the fleet key; never to one named
  in a request.
- `GET /admin/status`: every replica with its address, health record, the weights, the retry
  budget, local processes and discovery.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from batcher.fleet.router.context import RouterContext
from batcher.http.errors import ApiError, invalid
from batcher.http.listener import add_fallback_route, expect_continue, read_body, read_json
from batcher.http.middleware import answer_errors, require_bearer
from batcher.http.responses import json_response

CONTEXT = web.AppKey("router", RouterContext)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def unknown_replica(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A replica id the registry does not know (a handler's KeyError) is a 404."""
    try:
        return await handler(request)
    except KeyError as exc:
        raise ApiError(404, f"no replica {exc.args[0]!r}", code="replica_not_found") from None


async def replica_status(ctx: RouterContext, replica_id: str, refresh: bool = True
                         ) -> dict[str, Any]:
    """The replica's drain view; `refresh` fetches its `/v1/state` first."""
    rep = ctx.registry.get(replica_id)
    if rep is None:
        raise KeyError(replica_id)
    if refresh and ctx.session is not None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with ctx.session.get(rep.url + "/v1/state",
                                       timeout=aiohttp.ClientTimeout(total=1.0)) as resp:
                if resp.status == 200:
                    ctx.registry.observe(rep.replica_id, orjson.loads(await resp.read()),
                                         ctx.clock())
    st = rep.state
    busy = st is None or st.running > 0 or st.waiting > 0
    return {"replica_id": replica_id, "version": rep.version,
            "router_draining": rep.router_draining,
            "draining": bool(st and st.draining), "router_inflight": rep.inflight,
            "running": st.running if st else None, "waiting": st.waiting if st else None,
            "idle": rep.router_draining and rep.inflight == 0 and not busy}


async def set_draining(ctx: RouterContext, replica_id: str, draining: bool) -> dict[str, Any]:
    """Drain or undrain one replica: on the router at once, then through the replica's admin
    listener when the router knows a trusted address for it."""
    rep = ctx.registry.get(replica_id)
    if rep is None:
        raise KeyError(replica_id)
    rep.router_draining = draining
    told: Any = None
    if rep.admin_url and ctx.session is not None:
        path = "/admin/drain" if draining else "/admin/undrain"
        headers = ({"Authorization": f"Bearer {ctx.cfg.replica_admin_key}"}
                   if ctx.cfg.replica_admin_key else {})
        try:
            async with ctx.session.post(rep.admin_url + path, headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                told = {"status": resp.status}
        except (aiohttp.ClientError, TimeoutError) as exc:
            told = {"error": type(exc).__name__}
    out = await replica_status(ctx, replica_id)
    out["replica_admin"] = told
    return out


async def body_of(request: web.Request) -> dict[str, Any]:
    raw = await read_body(request)
    data = await read_json(request, raw) if raw.strip() else {}
    if not isinstance(data, dict):
        raise invalid("the body must be a JSON object", None, "invalid_type")
    return data


def text_field(data: dict[str, Any], key: str) -> str:
    v = data.get(key)
    if not isinstance(v, str) or not v:
        raise invalid(f"'{key}' is required", key, "missing")
    return v


async def status(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    now = ctx.clock()
    health = ctx.health.records if ctx.health is not None else {}
    reps = ctx.registry.snapshot(now)
    for r in reps:
        rec = health.get(r["replica_id"])
        if rec is not None:
            r["health"] = {"fails": rec.fails, "passes": rec.passes,
                           "evictions": rec.evictions, "probes": rec.probes,
                           "last_error": rec.last_error, "last_probe_ok": rec.last_probe_ok,
                           "readmitted_after": rec.readmitted_after}
    return json_response({
        "replicas": reps, "weights": ctx.rollout.weights, "inflight": ctx.inflight,
        "retry_budget": {"allowed_per_caller": ctx.budget.allowed(now),
                         "callers": len(ctx.budget),
                         "retries_in_window": ctx.budget.retries_in_window(now)},
        "processes": ctx.processes() if ctx.processes is not None else None,
        "discovery": ctx.discovery.status() if ctx.discovery is not None else None})


async def drain(request: web.Request) -> web.Response:
    data = await body_of(request)
    ctx = request.app[CONTEXT]
    return json_response(await set_draining(ctx, text_field(data, "replica"),
                                            request.path.endswith("/drain")))


async def one(request: web.Request) -> web.Response:
    return json_response(await replica_status(request.app[CONTEXT], request.match_info["id"]))


async def weights(request: web.Request) -> web.Response:
    rollout = request.app[CONTEXT].rollout
    if request.method == "POST":
        data = await body_of(request)
        action = request.path.rsplit("/", 1)[-1]
        try:
            if action == "canary":
                w = data.get("weight")
                if isinstance(w, bool) or not isinstance(w, (int, float)):
                    raise ValueError("'weight' is required (a share in [0, 1])")
                rollout.canary(text_field(data, "version"), float(w))
            elif action == "promote":
                rollout.promote(text_field(data, "version"))
            elif action == "rollback":
                rollout.rollback(text_field(data, "version"))
            elif data.get("weights") is None:
                rollout.clear()
            else:
                rollout.set(data["weights"])
        except ValueError as exc:
            raise invalid(str(exc), "weights") from None
    return json_response({"weights": rollout.weights})


async def config(request: web.Request) -> web.Response:
    """The effective configuration, for `batcher diagnose --review` (no keys in it)."""
    ctx = request.app[CONTEXT]
    cfg = ctx.cfg
    return json_response({
        "kind": "router", "routing": cfg.routing, "replicas": len(ctx.registry),
        "retry": {"max_attempts": cfg.max_attempts, "retry_ratio": cfg.retry_ratio,
                  "retry_floor": cfg.retry_floor},
        # The deep probe needs a key the replicas accept on /v1/probe.
        "deep_probe": bool(cfg.replica_admin_key or cfg.fleet_key),
        "probe_interval_s": cfg.health.probe_interval,
        "default_max_tokens": cfg.policy.default_max_tokens,
        "upstream_timeout_s": cfg.upstream_timeout})


def create_admin_app(ctx: RouterContext, admin_key: str) -> web.Application:
    if not admin_key:
        raise ValueError("the admin listener needs a key")
    app = web.Application(middlewares=[
        answer_errors, require_bearer(admin_key, "invalid admin key"), unknown_replica])
    app[CONTEXT] = ctx
    routes: list[tuple[str, str, Handler]] = [
        ("GET", "/admin/status", status), ("GET", "/admin/config", config),
        ("POST", "/admin/drain", drain),
        ("POST", "/admin/undrain", drain), ("GET", "/admin/replicas/{id}", one),
        ("GET", "/admin/weights", weights),
        *(("POST", f"/admin/{a}", weights) for a in ("weights", "canary", "promote", "rollback"))]
    for method, path, handler in routes:
        app.router.add_route(method, path, handler, expect_handler=expect_continue)
    add_fallback_route(app)
    return app
