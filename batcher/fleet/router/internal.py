"""The router's internal listener: replicas' heartbeats (`POST /internal/heartbeat`), never on
the public port.

Contract:
- With a fleet key, a beat must carry `Authorization: Bearer FLEET_KEY` (401 otherwise, checked
  in constant time before the body is read). Without one the listener must be on loopback only
  (`batcher router` refuses to start otherwise).
- Beats are rate-limited per source address (429 + Retry-After, before the body is read), bodies
  are capped at `MAX_BEAT_BYTES`, and the registry refuses a beat that would repoint a live
  replica or register one past the cap (409 / 503, logged). So a flood costs little and never
  displaces the replicas already known.
- Only a beat that carried the fleet key may announce an `admin_url`.
"""

from __future__ import annotations

import logging

from aiohttp import web

from batcher.fleet.router.context import RouterContext
from batcher.fleet.router.ratelimit import SourceLimiter
from batcher.fleet.router.registry import BeatRefused
from batcher.http.errors import ApiError
from batcher.http.keys import bearer_matches
from batcher.http.listener import add_fallback_route, expect_continue, read_json
from batcher.http.middleware import answer_errors
from batcher.http.responses import json_response

log = logging.getLogger("batcher.fleet.internal")

MAX_BEAT_BYTES = 64 * 1024
CONTEXT = web.AppKey("router", RouterContext)
LIMITER = web.AppKey("beat_limiter", SourceLimiter)


async def heartbeat(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    source = request.remote or "unknown"
    key = ctx.cfg.fleet_key
    authorized = not key or bearer_matches(request.headers, key)
    # NOTE: beats without the key count in a bucket of their own, so a flood of them from a
    # host that also runs replicas cannot starve the real beats.
    limiter = request.app[LIMITER]
    if not limiter.allow(f"{source} {authorized}", ctx.clock()):
        ctx.metrics.beats.labels("rate_limited").inc()
        raise ApiError(429, "too many heartbeats from this address", code="rate_limited",
                       retry_after=limiter.retry_after())
    if not authorized:
        ctx.metrics.beats.labels("unauthorized").inc()
        raise ApiError(401, "invalid fleet key", code="invalid_api_key")
    payload = await read_json(request)
    if not isinstance(payload, dict):
        raise ApiError(400, "a heartbeat is a JSON object", code="invalid_heartbeat")
    try:
        accepted = ctx.registry.beat(payload, ctx.clock(), trusted=bool(key))
    except BeatRefused as exc:
        ctx.metrics.beats.labels("refused").inc()
        # The id and address are the operator's lead; the payload may hold anything.
        log.warning("heartbeat from %s refused: %s", source, exc)
        raise ApiError(exc.status, str(exc), code="heartbeat_refused") from None
    except ValueError as exc:
        ctx.metrics.beats.labels("invalid").inc()
        raise ApiError(400, str(exc), code="invalid_heartbeat") from None
    ctx.metrics.beats.labels("accepted" if accepted else "stale").inc()
    return json_response({"accepted": accepted})


def create_internal_app(ctx: RouterContext) -> web.Application:
    app = web.Application(middlewares=[answer_errors], client_max_size=MAX_BEAT_BYTES)
    app[CONTEXT] = ctx
    app[LIMITER] = SourceLimiter(ctx.cfg.beats_per_source, ctx.cfg.beat_burst)
    app.router.add_post("/internal/heartbeat", heartbeat, expect_handler=expect_continue)
    add_fallback_route(app)
    return app
