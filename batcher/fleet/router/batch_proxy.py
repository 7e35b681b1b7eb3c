"""`/v1/files` and `/v1/batches` through the router.

A file is uploaded to the routable replica with the most headroom (fewest waiting requests, then
most free KV, then fewest running), or, with `--batch-pool`, to the pool's replica with the most
headroom; a batch is created where its input file is (its lines run on that replica's spare
capacity). Every later call on a file or batch goes to the replica its id names (`batch_ids.py`).
Lists merge the answers of every replica the router trusts (`Registry.trusted`: healthy, ready,
not evicted) for the caller. The router checks nothing about tenants: it passes the caller's key
on, to trusted replicas only, and each answers for that key's tenant only, exactly as when called
directly. A replica that cannot be reached is a 503 (OpenAI's error shape, Retry-After) for the
objects it holds; a list leaves it out and says `"partial": true` (as it does when a registered
replica is not trusted), so one replica down does not fail every tenant's listing.
"""

from __future__ import annotations

from aiohttp import web

from batcher.fleet.router import batch_ids
from batcher.fleet.router.batch_files import file_content, upload_file
from batcher.fleet.router.batch_lists import list_batches, list_files
from batcher.fleet.router.batch_replicas import (
    PROXY,
    BatchProxy,
    Unreachable,
    call_headers,
    forward_one,
    owner,
    passed_on,
    unavailable,
)
from batcher.fleet.router.context import RouterContext
from batcher.http.errors import invalid
from batcher.http.listener import expect_continue, read_body, read_json
from batcher.http.responses import json_response


# files ---------------------------------------------------------------------------------------
async def get_file(request: web.Request) -> web.Response:
    return await forward_one(request, "file", "GET")


async def delete_file(request: web.Request) -> web.Response:
    return await forward_one(request, "file", "DELETE")


# batches -------------------------------------------------------------------------------------
async def create_batch(request: web.Request) -> web.Response:
    body = await read_json(request, await read_body(request))
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise invalid("'input_file_id' is required", "input_file_id", "missing")
    rep, inner = owner(request, "file", file_id, "input_file_id")
    proxy = request.app[PROXY]
    try:
        status, answer = await proxy.call(rep, "POST", "/v1/batches", call_headers(request),
                                          json={**body, "input_file_id": inner})
    except Unreachable:
        raise unavailable(f"file {file_id!r}") from None
    if status != 200:
        return passed_on(status, answer)
    return json_response(batch_ids.outward(answer, rep.replica_id))


async def get_batch(request: web.Request) -> web.Response:
    return await forward_one(request, "batch", "GET")


async def cancel_batch(request: web.Request) -> web.Response:
    return await forward_one(request, "batch", "POST", "/cancel")


def add_batch_routes(app: web.Application, ctx: RouterContext) -> None:
    """The batch API on the router's public app (before its catch-all route)."""
    app[PROXY] = BatchProxy(ctx)
    for method, path, handler in (
            ("POST", "/v1/files", upload_file), ("GET", "/v1/files", list_files),
            ("GET", "/v1/files/{file_id}", get_file),
            ("DELETE", "/v1/files/{file_id}", delete_file),
            ("GET", "/v1/files/{file_id}/content", file_content),
            ("POST", "/v1/batches", create_batch), ("GET", "/v1/batches", list_batches),
            ("GET", "/v1/batches/{batch_id}", get_batch),
            ("POST", "/v1/batches/{batch_id}/cancel", cancel_batch)):
        app.router.add_route(method, path, handler, expect_handler=expect_continue)
