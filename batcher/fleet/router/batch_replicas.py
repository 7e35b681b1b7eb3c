"""Reaching the replica that holds a file or batch for the router's batch API: which replica an
id names (and whether it is trusted with the caller's key), which replicas serve the batch API
at all, one JSON call to a replica, and a replica's refusal passed on as it came."""

from __future__ import annotations

import time
import urllib.parse
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from batcher.fleet.router import batch_ids
from batcher.fleet.router.context import RouterContext
from batcher.fleet.router.forward import PASS_HEADERS
from batcher.fleet.router.registry import Registry, Replica
from batcher.http.errors import ApiError
from batcher.http.responses import json_response

CALL_TIMEOUT = aiohttp.ClientTimeout(total=10.0)
# How long the router remembers whether a replica serves the batch API at all.
CAPABLE_TTL_S = 30.0
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
            raise passed_error(status, body)
        capable = status == 200
        if capable or error_code(body) == "batch_api_disabled":
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


def error_code(body: Any) -> str | None:
    err = body.get("error") if isinstance(body, dict) else None
    return err.get("code") if isinstance(err, dict) else None


def passed_on(status: int, body: Any) -> web.Response:
    """A replica's refusal, passed on as it came (it is already in OpenAI's shape)."""
    if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
        body = {"error": {"message": f"the replica answered {status}", "type": "api_error",
                          "param": None, "code": None}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def unavailable(what: str) -> ApiError:
    return ApiError(503, f"the replica holding {what} is not reachable; retry later",
                    code="replica_unavailable", retry_after=2)


PROXY = web.AppKey("batch_proxy", BatchProxy)


def call_headers(request: web.Request) -> dict[str, str]:
    h = {k: v for k in PASS_HEADERS if (v := request.headers.get(k)) is not None}
    h["X-Request-Id"] = request["request_id"]
    return h


def owner(request: web.Request, kind: str, router_id: str | None = None,
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
        raise unavailable(f"{kind} {router_id!r}")
    return rep, decoded[0]


def quoted(inner: str) -> str:
    return urllib.parse.quote(inner, safe="")


async def forward_one(request: web.Request, kind: str, method: str, suffix: str = "",
                      json: Any = None) -> web.Response:
    """Forward a call on one object to its replica; its JSON answer with router ids."""
    rep, inner = owner(request, kind)
    proxy = request.app[PROXY]
    path = f"{KINDS[kind][2]}/{quoted(inner)}{suffix}"
    try:
        status, body = await proxy.call(rep, method, path, call_headers(request), json=json)
    except Unreachable:
        raise unavailable(f"{kind} {request.match_info[KINDS[kind][0]]!r}") from None
    if status != 200:
        return passed_on(status, body)
    return json_response(batch_ids.outward(body, rep.replica_id))


def passed_error(status: int, body: Any) -> ApiError:
    err = body.get("error") if isinstance(body, dict) else None
    err = err if isinstance(err, dict) else {}
    return ApiError(status, str(err.get("message") or f"the replica answered {status}"),
                    param=err.get("param"), code=err.get("code"))
