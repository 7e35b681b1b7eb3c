"""`/v1/files` and `/v1/batches` in OpenAI's shapes, scoped by tenant.

Limits are checked before work: an upload's declared length (against the file limit and the
tenant's storage quota) before reading it and its actual bytes while streaming it to disk
(`file_upload.py`); a batch input's line count, line sizes and shapes and endpoint when the file
is uploaded and again when a batch is created, then each line as its live request
(`validate.py`): a line that can never run is answered then, alone. Files are read and checked in
worker threads, a chunk at a time. A batch whose input does not match its endpoint is created
`failed` with its `errors`, as OpenAI does; everything else a client gets wrong is a 4xx in
OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from aiohttp import web

from batcher.batch.api_state import batch_service, tenant_of
from batcher.batch.file_upload import upload_file
from batcher.batch.jsonl import ENDPOINTS
from batcher.batch.records import TERMINAL, new_id
from batcher.batch.store import CreatedBounds
from batcher.batch.validate import StagedInput
from batcher.http.errors import ApiError, invalid
from batcher.http.list_query import list_limit
from batcher.http.responses import json_response

MAX_METADATA_KEYS = 16
_WINDOW = re.compile(r"([1-9][0-9]{0,6})([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S = 7 * 86400


def parse_window(value: Any) -> float:
    """`completion_window` ("24h", or any `<n>s|m|h|d` up to 7 days) in seconds."""
    m = _WINDOW.fullmatch(value) if isinstance(value, str) else None
    seconds = int(m.group(1)) * _UNIT_S[m.group(2)] if m else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise invalid("'completion_window' must be a duration such as '24h' (a number and "
                      "s, m, h or d; at most 7 days)", "completion_window")
    return float(seconds)


def _created(request: web.Request) -> CreatedBounds | None:
    """`created_before` / `created_since` (Unix seconds): a creation-time window, with which a
    router continues a page merged from several replicas."""
    bounds: dict[str, int] = {}
    for name in ("created_before", "created_since"):
        raw = request.query.get(name)
        if raw is None:
            continue
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 12:
            raise invalid(f"'{name}' must be a Unix time in seconds", name)
        bounds[name.removeprefix("created_")] = int(raw)
    return CreatedBounds(**bounds) if bounds else None


def _page(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


# files ---------------------------------------------------------------------------------------
async def list_files(request: web.Request) -> web.Response:
    svc = batch_service(request)
    tenant = tenant_of(request)
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("'order' must be 'asc' or 'desc'", "order")
    purpose = request.query.get("purpose")
    after = request.query.get("after")
    if after is not None and svc.store.get_file(tenant, after) is None:
        raise invalid(f"'after' names no file of yours: {after!r}", "after")
    limit = list_limit(request.query)
    files, more = svc.store.list_files(tenant, limit, after, purpose, order == "asc",
                                       _created(request))
    return json_response(_page([f.to_openai() for f in files], more))


def _file(request: web.Request, svc: BatchService):
    file_id = request.match_info["file_id"]
    rec = svc.store.get_file(tenant_of(request), file_id)
    if rec is None:
        raise ApiError(404, f"no such file: {file_id!r}", param="file_id", code="file_not_found")
    return rec


async def get_file(request: web.Request) -> web.Response:
    return json_response(_file(request, batch_service(request)).to_openai())


async def file_content(request: web.Request) -> web.StreamResponse:
    svc = batch_service(request)
    rec = _file(request, svc)
    path = svc.store.path(rec.id)
    if not path.exists():
        raise ApiError(404, f"the content of {rec.id!r} is gone", param="file_id",
                       code="file_not_found")
    return web.FileResponse(path, headers={"Content-Type": "application/jsonl"})


async def delete_file(request: web.Request) -> web.Response:
    svc = batch_service(request)
    rec = _file(request, svc)
    svc.store.delete_file(rec.tenant, rec.id)
    return json_response({"id": rec.id, "object": "file", "deleted": True})


# batches -------------------------------------------------------------------------------------
async def create_batch(request: web.Request) -> web.Response:
    from batcher.http.listener import read_json

    svc = batch_service(request)
    tenant = tenant_of(request)
    if "batch" not in request["tenant"].priorities:  # every line would be refused
        raise ApiError(403, "this API key may not submit batch work (priority 'batch' is not "
                       "allowed for it)", code="priority_not_allowed")
    body = await read_json(request)
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise invalid(f"'endpoint' must be one of {list(ENDPOINTS)}", "endpoint")
    window = body.get("completion_window", "24h")
    window_s = parse_window(window)
    metadata = _metadata(body.get("metadata"))
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise invalid("'input_file_id' is required", "input_file_id", "missing")
    rec = svc.store.get_file(tenant, file_id)
    if rec is None:
        raise ApiError(404, f"no such file: {file_id!r}", param="input_file_id",
                       code="file_not_found")
    if rec.purpose != "batch":
        raise invalid(f"file {file_id!r} has purpose {rec.purpose!r}; a batch input needs "
                      "'batch'", "input_file_id")
    bid = new_id("batch_")
    try:
        staged = await asyncio.to_thread(StagedInput, svc.store.path(file_id), bid, endpoint,
                                         svc.check, svc.limits.max_lines,
                                         svc.limits.max_line_bytes)
    except FileNotFoundError:  # deleted (or expired) since the lookup
        raise ApiError(404, f"no such file: {file_id!r}", param="input_file_id",
                       code="file_not_found") from None
    try:
        # Each chunk is read and validated in a worker thread and stored in its own short
        # transaction on the loop.
        while (rows := await asyncio.to_thread(staged.next_rows)) is not None:
            if rows:
                svc.store.stage_lines(rows)
        problems = staged.problems()
    except BaseException:  # the caller left, or a bug: the staged lines belong to no batch
        svc.store.drop_lines(bid)
        raise
    finally:
        staged.close()
    if problems:
        svc.store.drop_lines(bid)
        batch = svc.store.create_failed_batch(tenant, endpoint, file_id, window, window_s,
                                              metadata, [p.to_json() for p in problems])
    else:
        batch = svc.store.open_batch(bid, tenant, endpoint, file_id, window, window_s,
                                     metadata, staged.total, staged.answered)
        svc.executor.add(batch)
    return json_response(batch.to_openai())


def _metadata(raw: Any) -> dict[str, str] | None:
    if raw is None:
        return None
    if (not isinstance(raw, dict) or len(raw) > MAX_METADATA_KEYS
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64
                       and len(v) <= 512 for k, v in raw.items())):
        raise invalid(f"'metadata' must be an object of at most {MAX_METADATA_KEYS} string "
                      "pairs (keys up to 64 characters, values up to 512)", "metadata")
    return raw


def _batch(request: web.Request, svc: BatchService):
    batch_id = request.match_info["batch_id"]
    rec = svc.store.get_batch(tenant_of(request), batch_id)
    if rec is None:
        raise ApiError(404, f"no such batch: {batch_id!r}", param="batch_id",
                       code="batch_not_found")
    return rec


async def get_batch(request: web.Request) -> web.Response:
    return json_response(_batch(request, batch_service(request)).to_openai())


async def list_batches(request: web.Request) -> web.Response:
    svc = batch_service(request)
    tenant = tenant_of(request)
    after = request.query.get("after")
    if after is not None and svc.store.get_batch(tenant, after) is None:
        raise invalid(f"'after' names no batch of yours: {after!r}", "after")
    limit = list_limit(request.query)
    batches, more = svc.store.list_batches(tenant, limit, after, _created(request))
    return json_response(_page([b.to_openai() for b in batches], more))


async def cancel_batch(request: web.Request) -> web.Response:
    svc = batch_service(request)
    rec = _batch(request, svc)
    if rec.status in TERMINAL and rec.status != "cancelled":
        raise ApiError(409, f"the batch is {rec.status}; only a running batch can be cancelled",
                       param="batch_id", code="batch_not_cancellable")
    if svc.store.set_status(rec.id, "cancelling", ("validating", "in_progress")):
        svc.executor.cancel(rec.id)
    fresh = svc.store.get_batch(rec.tenant, rec.id)
    assert fresh is not None
    return json_response(fresh.to_openai())


def add_routes(app: web.Application, **route_kw: Any) -> None:
    """Register the routes (before any catch-all route); they answer 404 until a
    `BatchService` is installed under `BATCH`."""
    r = app.router
    r.add_post("/v1/files", upload_file, **route_kw)
    r.add_get("/v1/files", list_files, **route_kw)
    r.add_get("/v1/files/{file_id}", get_file, **route_kw)
    r.add_delete("/v1/files/{file_id}", delete_file, **route_kw)
    r.add_get("/v1/files/{file_id}/content", file_content, **route_kw)
    r.add_post("/v1/batches", create_batch, **route_kw)
    r.add_get("/v1/batches", list_batches, **route_kw)
    r.add_get("/v1/batches/{batch_id}", get_batch, **route_kw)
    r.add_post("/v1/batches/{batch_id}/cancel", cancel_batch, **route_kw)
