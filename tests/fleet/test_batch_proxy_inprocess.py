"""The batch API in-process. The router against a stub replica that records what it is asked:
an id whose replica part is not a replica's own id shape (`..`, `.`) is a 404 that reaches no
replica path, list parameters that only look like numbers are 400s, not 500s (on the replica
too), and an upload no replica answered is a 503. The replica's routes alone: a huge form field
is refused as it streams in. Milliseconds; `test_batch_router.py` runs the whole API against
processes."""

from __future__ import annotations

import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import FormData, web
from aiohttp.test_utils import TestServer

from batcher.batch.api_state import BATCH, BatchLimits, BatchService
from batcher.batch.routes import add_routes
from batcher.batch.store import BatchStore
from batcher.fleet.router import batch_ids
from batcher.fleet.router.context import RouterConfig, RouterContext
from batcher.fleet.router.proxy import create_router_app
from batcher.http.middleware import answer_errors
from batcher.admission.tenants import TenantConfig
from tests.fleet.procs import free_port

KEY = {"Authorization": "Bearer some-key"}
HEALTH_PATHS = ("/health", "/v1/state", "/v1/probe")  # the router's health checker asks these
STATE = {"free_blocks": 10, "total_blocks": 10, "block_size": 16, "running": 0, "waiting": 0,
         "version": "v1", "draining": False, "healthy": True}


def calls(seen: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """What the stub was asked apart from health checks."""
    return [(m, p) for m, p in seen if not p.startswith(HEALTH_PATHS)]


@pytest.fixture
async def stub() -> AsyncIterator[tuple[TestServer, list[tuple[str, str]]]]:
    """A replica that answers every path with an empty list and records (method, path)."""
    seen: list[tuple[str, str]] = []

    async def anything(request: web.Request) -> web.Response:
        seen.append((request.method, request.raw_path))
        if request.path == "/v1/state":  # healthy, so the router trusts it
            return web.json_response(STATE)
        if request.path.startswith(HEALTH_PATHS):
            return web.json_response({"status": "ok", "ok": True, "latency_ms": 1.0})
        return web.json_response({"object": "list", "data": [], "has_more": False})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield server, seen
    await server.close()


async def test_dot_segment_ids_reach_no_replica_path(aiohttp_client, stub) -> None:
    server, seen = stub
    ctx = RouterContext(RouterConfig())
    ctx.registry.add_static(str(server.make_url("")).rstrip("/"), "r0")
    ctx.registry.observe("r0", STATE, ctx.clock())
    client = await aiohttp_client(create_router_app(ctx))
    for inner in ("..", ".", "a.b", "x%2F..", " "):
        rid = batch_ids.encode(inner, "r0")
        for method, path in (("GET", f"/v1/files/{rid}"), ("GET", f"/v1/files/{rid}/content"),
                             ("DELETE", f"/v1/files/{rid}"),
                             ("GET", f"/v1/batches/{rid}"),
                             ("POST", f"/v1/batches/{rid}/cancel")):
            resp = await client.request(method, path.replace("%", "%25"), headers=KEY)
            body = await resp.json()
            assert resp.status == 404, (inner, method, path, body)
            assert body["error"]["code"] in ("file_not_found", "batch_not_found")
        resp = await client.post("/v1/batches", headers=KEY, json={
            "input_file_id": rid, "endpoint": "/v1/completions", "completion_window": "24h"})
        assert resp.status == 404 and (await resp.json())["error"]["param"] == "input_file_id"
    assert calls(seen) == []
    # A well-formed id still reaches its replica, at the one path it names.
    resp = await client.get(f"/v1/files/{batch_ids.encode('file-0a1b', 'r0')}", headers=KEY)
    assert resp.status == 200 and calls(seen) == [("GET", "/v1/files/file-0a1b")]


async def test_router_list_limit_that_int_refuses_is_a_400(aiohttp_client, stub) -> None:
    server, seen = stub
    ctx = RouterContext(RouterConfig())
    ctx.registry.add_static(str(server.make_url("")).rstrip("/"), "r0")
    client = await aiohttp_client(create_router_app(ctx))
    for path in ("/v1/files", "/v1/batches"):
        for limit in ("²", "1²", "٣", "0", "101", "-1", ""):
            resp = await client.get(path, params={"limit": limit}, headers=KEY)
            body = await resp.json()
            assert resp.status == 400 and body["error"]["param"] == "limit", (limit, body)
    assert calls(seen) == []


def replica_app(store: BatchStore) -> web.Application:
    """The replica's batch routes alone, every caller one tenant. Uploads and lists read only
    the store: no executor is started."""
    tenant = TenantConfig(name="acme", key_sha256=(), tokens_per_minute=1e9, max_concurrent=4)

    @web.middleware
    async def as_tenant(request: web.Request, handler):
        request["tenant"] = tenant
        return await handler(request)

    app = web.Application(middlewares=[answer_errors, as_tenant], client_max_size=1 << 30)
    add_routes(app)
    app[BATCH] = BatchService(store, None, BatchLimits())  # type: ignore[arg-type]
    return app


async def test_replica_list_numbers_that_int_refuses_are_400s(aiohttp_client,
                                                              tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    client = await aiohttp_client(replica_app(store))
    try:
        for path in ("/v1/files", "/v1/batches"):
            for name, value in (("limit", "²"), ("limit", "٣"), ("created_before", "²"),
                                ("created_since", "1٣")):
                resp = await client.get(path, params={name: value})
                body = await resp.json()
                assert resp.status == 400 and body["error"]["param"] == name, (name, body)
            resp = await client.get(path, params={"limit": "5", "created_before": "9"})
            assert resp.status == 200 and (await resp.json())["data"] == []
    finally:
        store.close()


async def test_an_upload_no_replica_answered_is_a_503_not_a_404(aiohttp_client) -> None:
    """Only replicas that said they have no batch API make the router's 404; one that did not
    answer is a retryable 503."""
    state = {"free_blocks": 10, "total_blocks": 10, "block_size": 16, "running": 0,
             "waiting": 0, "version": "v1", "draining": False, "healthy": True}
    upload = {"data": b"--X\r\n\r\n--X--\r\n",
              "headers": {**KEY, "Content-Type": "multipart/form-data; boundary=X"}}

    async def disabled(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "off", "type": "not_found_error",
                                            "param": None, "code": "batch_api_disabled"}},
                                 status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", disabled)
    off = TestServer(app, host="127.0.0.1")
    await off.start_server()
    try:
        ctx = RouterContext(RouterConfig())
        gone = free_port()  # a port nothing listens on
        ctx.registry.add_static(f"http://127.0.0.1:{gone}", "gone")
        ctx.registry.observe("gone", state, ctx.clock())
        client = await aiohttp_client(create_router_app(ctx))
        resp = await client.post("/v1/files", **upload)
        body = await resp.json()
        assert resp.status == 503 and body["error"]["code"] == "no_replica", body
        assert resp.headers["Retry-After"]
        ctx.registry.remove("gone")
        ctx.registry.add_static(str(off.make_url("")).rstrip("/"), "off")
        ctx.registry.observe("off", state, ctx.clock())
        resp = await client.post("/v1/files", **upload)
        body = await resp.json()
        assert resp.status == 404 and body["error"]["code"] == "batch_api_disabled", body
    finally:
        await off.close()


async def test_a_huge_purpose_field_is_a_400_not_read_whole(aiohttp_client,
                                                             tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    client = await aiohttp_client(replica_app(store))
    line = (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
            b'"body": {"model": "m", "prompt": "hi"}}\n')
    huge = 8 << 20

    async def body():  # streamed in 64 KiB pieces: the client holds none of it
        yield (b'--X\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n')
        for _ in range(huge >> 16):
            yield b"b" * (1 << 16)
        yield (b'\r\n--X\r\nContent-Disposition: form-data; name="file"; '
               b'filename="in.jsonl"\r\n\r\n' + line + b"\r\n--X--\r\n")

    try:
        tracemalloc.start()
        try:
            resp = await client.post("/v1/files", data=body(), headers={
                "Content-Type": "multipart/form-data; boundary=X"})
            out = await resp.json()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert resp.status == 400 and out["error"]["param"] == "purpose", out
        assert peak < huge / 4, peak  # refused as it streams in, never held whole
        form = FormData()
        form.add_field("purpose", " batch\n")
        form.add_field("file", line, filename="in.jsonl")
        resp = await client.post("/v1/files", data=form)
        body = await resp.json()
        assert resp.status == 200 and body["purpose"] == "batch", body
    finally:
        store.close()


async def test_a_list_asks_trusted_replicas_only_and_survives_one_down(aiohttp_client) -> None:
    """A replica registered by a beat but never reached is not sent a tenant's key; one that
    does not answer leaves the list partial, not a 503 for every tenant."""
    state = {"free_blocks": 10, "total_blocks": 10, "block_size": 16, "running": 0,
             "waiting": 0, "version": "v1", "draining": False, "healthy": True}
    keys: dict[str, list[str | None]] = {"good": [], "unready": []}

    def recording(name: str, data: list[dict]) -> web.Application:
        async def anything(request: web.Request) -> web.Response:
            if not request.path.startswith("/v1/files"):  # health checks: unready stays so
                return web.json_response(state, status=500 if name == "unready" else 200)
            keys[name].append(request.headers.get("Authorization"))
            return web.json_response({"object": "list", "data": data, "has_more": False})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", anything)
        return app

    good = TestServer(recording("good", [{"id": "file-a", "object": "file",
                                          "created_at": 1}]), host="127.0.0.1")
    unready = TestServer(recording("unready", []), host="127.0.0.1")
    for s in (good, unready):
        await s.start_server()
    try:
        ctx = RouterContext(RouterConfig())
        ctx.registry.add_static(str(good.make_url("")).rstrip("/"), "good")
        ctx.registry.observe("good", state, ctx.clock())
        ctx.registry.beat({**state, "replica_id": "unready", "epoch": 1, "seq": 1,
                           "url": str(unready.make_url("")).rstrip("/")}, ctx.clock(), True)
        gone = free_port()  # a port nothing listens on
        ctx.registry.add_static(f"http://127.0.0.1:{gone}", "gone")
        ctx.registry.observe("gone", state, ctx.clock())
        client = await aiohttp_client(create_router_app(ctx))
        resp = await client.get("/v1/files", headers=KEY)
        body = await resp.json()
        assert resp.status == 200, body
        assert [x["id"] for x in body["data"]] == [batch_ids.encode("file-a", "good")]
        assert body["partial"] is True
        assert keys == {"good": [KEY["Authorization"]], "unready": []}
        # Nor does a call on an object the unready replica would hold reach it.
        resp = await client.get(f"/v1/files/{batch_ids.encode('file-b', 'unready')}",
                                headers=KEY)
        assert resp.status == 503 and (await resp.json())["error"]["code"] == (
            "replica_unavailable")
        assert keys["unready"] == []
        # With the untrusted and the unreachable one gone, the list is whole again.
        ctx.registry.remove("unready")
        ctx.registry.remove("gone")
        body = await (await client.get("/v1/files", headers=KEY)).json()
        assert "partial" not in body and len(body["data"]) == 1, body
    finally:
        for s in (good, unready):
            await s.close()
