"""Rollout: drain a replica, canary a version by weight, promote or roll back; the router's
admin API (own port, own key; never on the public port).

Contract:
- `Rollout.weights` maps versions to weights; `"*"` is every version not named; empty means
  every version. `canary(v, w)` sends share `w` to `v` and the rest to the others, `promote(v)`
  sends everything to `v`, `rollback(v)` sends nothing to `v`.
- Drain (`POST /admin/drain {"replica": id, "admin_url"?: url}`): the router stops routing to
  the replica at once, asks the replica's admin listener to drain (so other routers learn it
  from the next heartbeat; the admin URL comes from `--replica URL,ADMIN_URL`, the body, or an
  `admin_url` in the replica's heartbeats), and reports `idle` once neither the router nor the
  replica holds any of its work.
"""

from __future__ import annotations

import contextlib
import hmac
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from batcher.fleet.policy import OTHERS

if TYPE_CHECKING:
    from batcher.fleet.context import RouterContext


class Rollout:
    """Version weights (pure)."""

    __slots__ = ("weights",)

    def __init__(self) -> None:
        self.weights: dict[str, float] = {}

    def set(self, weights: dict[str, float]) -> None:
        if not isinstance(weights, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                and v >= 0 for k, v in weights.items()):
            raise ValueError("weights must map version names to numbers >= 0")
        self.weights = {k: float(v) for k, v in weights.items()}

    def canary(self, version: str, weight: float) -> None:
        if not 0.0 <= weight <= 1.0:
            raise ValueError("a canary weight is a share in [0, 1]")
        self.weights = {version: weight, OTHERS: 1.0 - weight}

    def promote(self, version: str) -> None:
        self.weights = {version: 1.0}

    def rollback(self, version: str) -> None:
        self.weights = {version: 0.0, OTHERS: 1.0}

    def clear(self) -> None:
        self.weights = {}


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload),
                        content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return json_response({"error": {"message": message, "type": "invalid_request_error",
                                    "param": None, "code": None}}, status)


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


async def set_draining(ctx: RouterContext, replica_id: str, draining: bool,
                       admin_url: str | None = None) -> dict[str, Any]:
    """Drain or undrain one replica (router side at once, then the replica's admin API at
    `admin_url`, or the one it was configured or heartbeated with)."""
    rep = ctx.registry.get(replica_id)
    if rep is None:
        raise KeyError(replica_id)
    if admin_url:
        rep.admin_url = admin_url.rstrip("/")
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


def create_admin_app(ctx: RouterContext, admin_key: str) -> web.Application:
    expected = f"Bearer {admin_key}".encode()

    @web.middleware
    async def check_key(request: web.Request, handler):
        got = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(got, expected):
            return _error(401, "invalid admin key")
        try:
            return await handler(request)
        except KeyError as exc:
            return _error(404, f"no replica {exc.args[0]!r}")
        except ValueError as exc:
            return _error(400, str(exc))

    async def body(request: web.Request) -> dict[str, Any]:
        try:
            data = orjson.loads(await request.read() or b"{}")
        except orjson.JSONDecodeError:
            raise ValueError("the body is not valid JSON") from None
        if not isinstance(data, dict):
            raise ValueError("the body must be a JSON object")  # noqa: TRY004 (answered 400)
        return data

    def field(data: dict[str, Any], key: str) -> str:
        v = data.get(key)
        if not isinstance(v, str) or not v:
            raise ValueError(f"'{key}' is required")
        return v

    async def status(request: web.Request) -> web.Response:
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
            "retry_budget": {"allowed": ctx.budget.allowed(now, ctx.inflight),
                             "retries_in_window": ctx.budget.retries_in_window},
            "processes": ctx.processes() if ctx.processes is not None else None,
            "discovery": ctx.discovery.status() if ctx.discovery is not None else None})

    async def drain(request: web.Request) -> web.Response:
        data = await body(request)
        return json_response(await set_draining(ctx, field(data, "replica"), True,
                                                data.get("admin_url") or None))

    async def undrain(request: web.Request) -> web.Response:
        data = await body(request)
        return json_response(await set_draining(ctx, field(data, "replica"), False,
                                                data.get("admin_url") or None))

    async def one(request: web.Request) -> web.Response:
        return json_response(await replica_status(ctx, request.match_info["id"]))

    async def weights(request: web.Request) -> web.Response:
        if request.method == "POST":
            data = await body(request)
            action = request.path.rsplit("/", 1)[-1]
            if action == "canary":
                w = data.get("weight")
                if isinstance(w, bool) or not isinstance(w, (int, float)):
                    raise ValueError("'weight' is required (a share in [0, 1])")
                ctx.rollout.canary(field(data, "version"), float(w))
            elif action == "promote":
                ctx.rollout.promote(field(data, "version"))
            elif action == "rollback":
                ctx.rollout.rollback(field(data, "version"))
            elif data.get("weights") is None:
                ctx.rollout.clear()
            else:
                ctx.rollout.set(data["weights"])
        return json_response({"weights": ctx.rollout.weights})

    app = web.Application(middlewares=[check_key])
    app.router.add_get("/admin/status", status)
    app.router.add_post("/admin/drain", drain)
    app.router.add_post("/admin/undrain", undrain)
    app.router.add_get("/admin/replicas/{id}", one)
    app.router.add_get("/admin/weights", weights)
    for action in ("weights", "canary", "promote", "rollback"):
        app.router.add_post(f"/admin/{action}", weights)
    return app
