"""The aiohttp application: middlewares (the replica's state for the fleet; request ID, auth,
errors and body limit in `batcher.http.middleware.api_middleware`), routes, and the engine's
lifetime in `cleanup_ctx`."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from aiohttp import web

from batcher.http.errors import ApiError
from batcher.http.keys import FLEET_KEY_HEADER, TENANT_HEADER, header_matches
from batcher.http.listener import add_fallback_route, expect_continue
from batcher.http.middleware import api_middleware, count_requests
from batcher.http.responses import json_response
from batcher.server import embeddings_route, messages_route, responses_route, tokenize_route
from batcher.server.appkeys import GATEWAY
from batcher.server.gateway import Gateway
from batcher.server.openai_routes import GenerationHandler
from batcher.server.probe import ProbeGuard
from batcher.server.responses_store import StoreConfig

log = logging.getLogger(__name__)

HANDLERS = web.AppKey("handlers", dict)
PROBE = web.AppKey("probe", ProbeGuard)
FLEET_KEY = web.AppKey("fleet_key", str)  # "" when the replica has none
# Optional: a request's body limit when it differs from the server's (None: the server's).
BODY_LIMIT = web.AppKey("body_limit", Callable[[web.Request], "int | None"])
TO_FLEET = "batcher.to_fleet"  # the caller is the fleet (or the replica has no fleet key)


def body_limit(request: web.Request) -> int:
    """The server's body limit, or the one an extension gives this request (the batch API's
    file uploads)."""
    override = request.app.get(BODY_LIMIT)
    return (override(request) if override is not None else None) or \
        request.app[GATEWAY].cfg.max_body_bytes


def authenticate(request: web.Request) -> None:
    request["tenant"] = request.app[GATEWAY].auth.authenticate_headers(request.headers)


def tenant_name(request: web.Request) -> str:
    return getattr(request.get("tenant"), "name", "-")


# Request ID on every response, body limit before reading, auth, errors in OpenAI's shape.
GATEWAY_MIDDLEWARE = api_middleware(body_limit=body_limit, authenticate=authenticate,
                                    caller=tenant_name, restamp_request_id=True)


@web.middleware
async def fleet_state(request: web.Request, handler: Callable[[web.Request],
                      Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """The replica's state on the fleet's answers (outside `api_middleware`, so its errors carry
    it too)."""
    gw = request.app[GATEWAY]
    fleet_key = request.app[FLEET_KEY]
    from_fleet = header_matches(request.headers, FLEET_KEY_HEADER, fleet_key)

    def state_header() -> str | None:
        """The piggybacked state, for the fleet only: its router, which sends the fleet key
        beside the tenant's (a replica without a fleet key serves a loopback fleet, and tells
        everyone the figures `/v1/state` tells anyone)."""
        if fleet_key and not from_fleet:
            return None
        st = gw.state()
        return orjson.dumps(st.to_wire() if from_fleet else st.public_wire()).decode()

    request["state_header"] = state_header
    request[TO_FLEET] = not fleet_key or from_fleet
    resp = await handler(request)
    if not resp.prepared:
        # DESIGN: the replica's state rides on the fleet's responses, errors included, so a
        # router's view is refreshed by all traffic; never on a refused credential.
        if resp.status == 401:
            resp.headers.popall("X-Replica-State", None)
        elif "X-Replica-State" not in resp.headers and (st := state_header()) is not None:
            resp.headers["X-Replica-State"] = st
    return resp


async def tenant_header(request: web.Request, response: web.StreamResponse) -> None:
    """The tenant the key resolved to, on answers to the fleet (where the replica's state goes):
    its router logs the request under the same name."""
    tenant = request.get("tenant")
    if tenant is not None and request.get(TO_FLEET):
        response.headers[TENANT_HEADER] = tenant.name


async def health(request: web.Request) -> web.Response:
    """Liveness: the loop answers. 503 once the engine has failed, saying why."""
    st = request.app[GATEWAY].engine.snapshot()
    if st.error:
        return json_response({"status": "error", "error": st.error}, 503)
    return json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    ok, why = request.app[GATEWAY].ready()
    return json_response({"ready": ok, "reason": why}, 200 if ok else 503)


async def state(request: web.Request) -> web.Response:
    """The contract keys and additions anyone may read; the private ones (prefix-cache hits,
    server-wide) only for the admin or fleet key."""
    st = request.app[GATEWAY].state()
    trusted = request.app[PROBE].holds_key(request.headers) or header_matches(
        request.headers, FLEET_KEY_HEADER, request.app[FLEET_KEY])
    return json_response(st.to_wire() if trusted else st.public_wire())


async def metrics(request: web.Request) -> web.Response:
    body = request.app[GATEWAY].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


async def probe(request: web.Request) -> web.Response:
    """One-token generation ahead of the queue, with a deadline (`?timeout=` seconds)."""
    gw = request.app[GATEWAY]
    guard = request.app[PROBE]
    guard.check(request.headers)  # an operator's tool: admin or fleet key, rate-limited
    try:
        timeout = float(request.query.get("timeout", "5"))
    except ValueError:
        timeout = math.nan
    if not math.isfinite(timeout):  # NaN would pass the clamp below as 0.01 s
        raise ApiError(400, "timeout must be a number of seconds", param="timeout")
    timeout = min(60.0, max(0.01, timeout))
    try:
        latency = await guard.run(lambda: gw.engine.probe(timeout), timeout)
    except TimeoutError:
        return json_response({"ok": False, "error": f"no token within {timeout:g}s"}, 503)
    except Exception as exc:  # noqa: BLE001 (the probe exists to report failures, not raise them)
        return json_response({"ok": False, "error": str(exc)}, 503)
    return json_response({"ok": True, "latency_ms": round(latency * 1000, 2)})


async def cancel(request: web.Request) -> web.Response:
    """DELETE /v1/requests/{id}: only the owning tenant may; anyone else gets 404."""
    gw = request.app[GATEWAY]
    client_id = request.match_info["id"]
    if not gw.cancel(request["tenant"].name, client_id):
        raise ApiError(404, f"no request '{client_id}' in flight", param="id",
                       code="request_not_found")
    return json_response({"id": client_id, "object": "request.cancelled", "cancelled": True})


def create_app(gw_factory: Callable[[], Awaitable[Gateway]], max_body_bytes: int,
               probe_keys: tuple[str | None, ...] = (),
               extend: Callable[[web.Application], None] | None = None,
               fleet_key: str | None = None,
               responses: StoreConfig | None = None) -> web.Application:
    """The public app. `gw_factory` builds the gateway (model, engine) at startup; cleanup
    stops the engine. `/v1/probe` takes any of `probe_keys` (the admin and fleet keys).
    `extend` adds routes and lifetimes of optional tiers (the batch API). With `fleet_key`,
    `X-Replica-State` goes only to callers that send it in `X-Fleet-Key` (the router).
    `responses`: where stored responses live (default: in memory)."""
    def count(route: str, status: str) -> None:
        if (gw := app.get(GATEWAY)) is not None:  # None: the gateway is not built yet
            gw.metrics.observe_request(route, status)

    # Counted outermost: the key and body refusals of the middlewares inside count too.
    app = web.Application(middlewares=[count_requests(count), fleet_state, GATEWAY_MIDDLEWARE],
                          client_max_size=max_body_bytes)
    app[PROBE] = ProbeGuard(probe_keys)
    app[FLEET_KEY] = fleet_key or ""

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        gw = await gw_factory()
        app[GATEWAY] = gw
        app[HANDLERS] = {"/v1/completions": GenerationHandler(gw, chat=False),
                         "/v1/chat/completions": GenerationHandler(gw, chat=True)}
        await gw.engine.start()
        yield
        if gw.embedder is not None:
            await gw.embedder.close()
        await gw.engine.stop()

    app.cleanup_ctx.append(lifetime)
    app.on_response_prepare.append(tenant_header)
    ex = {"expect_handler": expect_continue}
    app.router.add_get("/health", health, **ex)
    app.router.add_get("/ready", ready, **ex)
    app.router.add_get("/v1/state", state, **ex)
    app.router.add_get("/metrics", metrics, **ex)
    app.router.add_post("/v1/probe", probe, **ex)
    app.router.add_get("/v1/models", tokenize_route.models, **ex)
    tokenize_route.add_routes(app, **ex)
    app.router.add_delete("/v1/requests/{id}", cancel, **ex)

    async def generation(request: web.Request) -> web.StreamResponse:
        return await request.app[HANDLERS][request.path](request)

    app.router.add_post("/v1/completions", generation, **ex)
    app.router.add_post("/v1/chat/completions", generation, **ex)
    app.router.add_post("/v1/embeddings", embeddings_route.handle, **ex)
    responses_route.install(app, responses or StoreConfig(), **ex)
    messages_route.install(app, **ex)
    if extend is not None:
        extend(app)  # before the catch-all route, which would shadow later ones
    add_fallback_route(app)
    return app
