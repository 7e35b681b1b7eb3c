"""`/v1/files` and `/v1/batches` in OpenAI's shapes, scoped by tenant.

Limits are checked before work: an upload's declared length (against the file limit and the
tenant's storage quota) before reading it and its actual bytes while streaming it to disk; a batch
input's line count, line sizes and shapes and endpoint when the file is uploaded and again when a
batch is created, then each line as its live request (`validate.py`): a line that can never run
is answered then, alone. Files are read and checked in worker threads, a chunk at a time. A batch
whose input does not match its endpoint is created `failed` with its `errors`, as OpenAI does;
everything else a client gets wrong is a 4xx in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from batcher.batch.executor import BatchExecutor
from batcher.batch.jsonl import ENDPOINTS, MAX_LINE_BYTES, MAX_LINES, LineProblem, check_file
from batcher.batch.records import TERMINAL, new_id
from batcher.batch.store import BatchStore, CreatedBounds
from batcher.batch.validate import LineCheck, StagedInput
from batcher.http.errors import ApiError, invalid
from batcher.http.responses import json_response
from batcher.http.text import excerpt, safe_filename

PURPOSES = ("batch",)
MAX_FILENAME_CHARS = 255
MAX_LIST_LIMIT = 100  # files and batches per page, as OpenAI's API
MAX_METADATA_KEYS = 16
# A form field other than the file ('purpose'): read whole, so bounded (the body's own limit is
# the file's).
MAX_FIELD_BYTES = 1024
_WINDOW = re.compile(r"([1-9][0-9]{0,6})([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S = 7 * 86400
# `expires_after.seconds` a client may ask for, as OpenAI's API bounds it (1 hour to 30 days).
MIN_EXPIRES_AFTER_S = 3600
MAX_EXPIRES_AFTER_S = 30 * 86400
_CHUNK = 1 << 16


@dataclass(slots=True)
class BatchLimits:
    """`max_tenant_bytes` / `max_tenant_files`: what one tenant may store (batch outputs
    included); `file_expiry_s`: a file's lifetime unless its upload asks otherwise (None:
    kept until deleted)."""

    max_file_bytes: int = 100 * 2**20
    max_lines: int = MAX_LINES
    max_line_bytes: int = MAX_LINE_BYTES
    max_tenant_bytes: int = 2 * 2**30
    max_tenant_files: int = 1000
    file_expiry_s: float | None = 30 * 86400.0

    def validate(self) -> BatchLimits:
        for name in ("max_file_bytes", "max_lines", "max_line_bytes", "max_tenant_bytes",
                     "max_tenant_files"):
            if getattr(self, name) < 1:
                raise ValueError(f"batch {name.replace('_', ' ')} must be >= 1")
        if self.file_expiry_s is not None and self.file_expiry_s <= 0:
            raise ValueError("batch file expiry must be > 0 seconds (or none)")
        return self


@dataclass(slots=True)
class BatchService:
    """What the routes share: the store, the executor, the limits and the line validation
    (None: lines are checked only for shape, and run to find the rest)."""

    store: BatchStore
    executor: BatchExecutor
    limits: BatchLimits
    check: LineCheck | None = None


BATCH = web.AppKey("batch_service", BatchService)


def _service(request: web.Request) -> BatchService:
    svc = request.app.get(BATCH)
    if svc is None:
        raise ApiError(404, "the batch API is not enabled on this server (start it with "
                       "--data-dir)", code="batch_api_disabled")
    return svc


def _tenant(request: web.Request) -> str:
    return request["tenant"].name


def parse_window(value: Any) -> float:
    """`completion_window` ("24h", or any `<n>s|m|h|d` up to 7 days) in seconds."""
    m = _WINDOW.fullmatch(value) if isinstance(value, str) else None
    seconds = int(m.group(1)) * _UNIT_S[m.group(2)] if m else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise invalid("'completion_window' must be a duration such as '24h' (a number and "
                      "s, m, h or d; at most 7 days)", "completion_window")
    return float(seconds)


def _limit(request: web.Request) -> int:
    raw = request.query.get("limit", "20")
    # isascii: str.isdigit() also takes digits int() refuses ('²'), which would be a 500.
    digits = raw.isascii() and raw.isdigit() and len(raw) <= 6  # int() of 5,000 digits raises
    if not digits or not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise invalid(f"'limit' must be an integer from 1 to {MAX_LIST_LIMIT}", "limit")
    return int(raw)


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


def _problems(problems: list[LineProblem]) -> ApiError:
    first = problems[0]
    where = f"line {first.line}: " if first.line else ""
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    return invalid(f"the file is not a valid batch input: {where}{first.message}{more}",
                   "file", first.code)


# files ---------------------------------------------------------------------------------------
def _quota(svc: BatchService, tenant: str, adding: int) -> int:
    """Bytes the tenant may still store; a 400 (`quota_exceeded`) when another file of
    `adding` bytes would pass its file count or its bytes."""
    lim = svc.limits
    count, used = svc.store.usage(tenant)
    if count + 1 > lim.max_tenant_files:
        raise invalid(f"you store {count} files, the most this server keeps for one API key; "
                      "delete some (or wait for them to expire)", "file", "quota_exceeded")
    if used + adding > lim.max_tenant_bytes:
        raise invalid(f"you store {used} bytes of files; with this upload ({adding} bytes or "
                      f"more) that would pass the {lim.max_tenant_bytes} bytes this server keeps "
                      "for one API key; delete some (or wait for them to expire)", "file",
                      "quota_exceeded")
    return lim.max_tenant_bytes - used


async def upload_file(request: web.Request) -> web.Response:
    svc = _service(request)
    tenant = _tenant(request)
    limit = svc.limits.max_file_bytes
    if request.content_length is not None and request.content_length > limit + _CHUNK:
        raise ApiError(413, f"the upload is {request.content_length} bytes; files are limited "
                       f"to {limit} bytes", code="file_too_large")
    # The declared length holds a little multipart framing around the file.
    room = _quota(svc, tenant, max(0, (request.content_length or 0) - _CHUNK))
    if not request.content_type.startswith("multipart/"):
        raise invalid("upload a file as multipart/form-data with 'file' and 'purpose' fields",
                      None, "invalid_content_type")
    purpose: str | None = None
    expiry: dict[str, str] = {}
    temp: Path | None = None
    filename = ""
    size = 0
    try:
        try:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    raise invalid("nested multipart bodies are not accepted", None)
                if part.name == "purpose":
                    purpose = await _field(part)
                elif part.name is not None and part.name.startswith("expires_after"):
                    if len(expiry) >= 2:
                        raise invalid("'expires_after' takes 'anchor' and 'seconds'",
                                      "expires_after")
                    expiry[part.name] = await _field(part)
                elif part.name == "file":
                    if temp is not None:
                        raise invalid("send one 'file' per upload", "file")
                    filename = safe_filename(part.filename)
                    temp = svc.store.temp_path()
                    size = await _save(part, temp, limit, room)
                else:
                    await part.release()
        except (ValueError, AssertionError, web.HTTPException, HttpProcessingError) as exc:
            if isinstance(exc, ApiError | web.HTTPException):
                raise
            raise invalid(f"the multipart body could not be read: {excerpt(exc, 200)}", None,
                          "invalid_body") from None
        if purpose not in PURPOSES:
            raise invalid(f"'purpose' must be one of {list(PURPOSES)}", "purpose")
        expires_after_s = _expires_after(expiry, svc.limits.file_expiry_s)
        if temp is None:
            raise invalid("'file' is required", "file", "missing")
        problems = await asyncio.to_thread(_check_upload, temp, svc.limits)
        if problems:
            raise _problems(problems)
        _quota(svc, tenant, size)  # again: other uploads may have finished meanwhile
        rec = svc.store.add_file(tenant, filename, purpose, temp, size,
                                 expires_after_s=expires_after_s)
        temp = None
    finally:
        if temp is not None:
            temp.unlink(missing_ok=True)
    return json_response(rec.to_openai())


def _check_upload(path: Path, limits: BatchLimits) -> list[LineProblem]:
    with path.open("rb") as f:
        return check_file(f, limits.max_lines, limits.max_line_bytes)


def _expires_after(fields: dict[str, str], default_s: float | None) -> float | None:
    """Seconds until the file expires: OpenAI's `expires_after` (`{"anchor": "created_at",
    "seconds": N}`, as form fields `expires_after[anchor]` and `expires_after[seconds]` or one
    JSON field), else the server's default."""
    if not fields:
        return default_s
    param = "expires_after"
    if param in fields:
        try:
            raw = orjson.loads(fields.pop(param))
        except orjson.JSONDecodeError:
            raw = None
        if not isinstance(raw, dict):
            raise invalid("'expires_after' must be an object with 'anchor' and 'seconds'",
                          param)
        fields.update({f"{param}[{k}]": v for k, v in raw.items()})
    anchor = fields.pop(f"{param}[anchor]", None)
    seconds = fields.pop(f"{param}[seconds]", None)
    if fields:
        raise invalid(f"unknown field {next(iter(fields))!r}; 'expires_after' takes 'anchor' "
                      "and 'seconds'", param)
    if anchor != "created_at":
        raise invalid("'expires_after.anchor' must be 'created_at'", f"{param}.anchor")
    text = str(seconds) if isinstance(seconds, int | str) else ""
    if not (text.isascii() and text.isdigit()
            and MIN_EXPIRES_AFTER_S <= int(text) <= MAX_EXPIRES_AFTER_S):
        raise invalid(f"'expires_after.seconds' must be an integer from {MIN_EXPIRES_AFTER_S} "
                      f"to {MAX_EXPIRES_AFTER_S}", f"{param}.seconds")
    return float(int(text))


async def _field(part: BodyPartReader) -> str:
    """A small form field's text; a 400 once it passes MAX_FIELD_BYTES."""
    data = bytearray()
    while chunk := await part.read_chunk(_CHUNK):
        data += chunk
        if len(data) > MAX_FIELD_BYTES:
            raise invalid(f"the '{part.name}' field is longer than {MAX_FIELD_BYTES} bytes",
                          part.name)
    return part.decode(bytes(data)).decode("utf-8", "replace").strip()


async def _save(part: BodyPartReader, path: Path, limit: int, room: int) -> int:
    """Stream the part to `path`; a 413 past `limit` bytes, a 400 `quota_exceeded` past the
    `room` left in the tenant's quota."""
    size = 0
    f = await asyncio.to_thread(path.open, "wb")
    try:
        while chunk := await part.read_chunk(_CHUNK):
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"files are limited to {limit} bytes", param="file",
                               code="file_too_large")
            if size > room:
                raise invalid(f"this upload would pass the storage this server keeps for one "
                              f"API key ({room} bytes left); delete some files (or wait for "
                              "them to expire)", "file", "quota_exceeded")
            f.write(chunk)  # one chunk into the page cache: not worth a thread hop
    finally:
        f.close()
    return size


async def list_files(request: web.Request) -> web.Response:
    svc = _service(request)
    tenant = _tenant(request)
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("'order' must be 'asc' or 'desc'", "order")
    purpose = request.query.get("purpose")
    after = request.query.get("after")
    if after is not None and svc.store.get_file(tenant, after) is None:
        raise invalid(f"'after' names no file of yours: {after!r}", "after")
    files, more = svc.store.list_files(tenant, _limit(request), after, purpose, order == "asc",
                                       _created(request))
    return json_response(_page([f.to_openai() for f in files], more))


def _file(request: web.Request, svc: BatchService):
    file_id = request.match_info["file_id"]
    rec = svc.store.get_file(_tenant(request), file_id)
    if rec is None:
        raise ApiError(404, f"no such file: {file_id!r}", param="file_id", code="file_not_found")
    return rec


async def get_file(request: web.Request) -> web.Response:
    return json_response(_file(request, _service(request)).to_openai())


async def file_content(request: web.Request) -> web.StreamResponse:
    svc = _service(request)
    rec = _file(request, svc)
    path = svc.store.path(rec.id)
    if not path.exists():
        raise ApiError(404, f"the content of {rec.id!r} is gone", param="file_id",
                       code="file_not_found")
    return web.FileResponse(path, headers={"Content-Type": "application/jsonl"})


async def delete_file(request: web.Request) -> web.Response:
    svc = _service(request)
    rec = _file(request, svc)
    svc.store.delete_file(rec.tenant, rec.id)
    return json_response({"id": rec.id, "object": "file", "deleted": True})


# batches -------------------------------------------------------------------------------------
async def create_batch(request: web.Request) -> web.Response:
    from batcher.http.listener import read_json

    svc = _service(request)
    tenant = _tenant(request)
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
    rec = svc.store.get_batch(_tenant(request), batch_id)
    if rec is None:
        raise ApiError(404, f"no such batch: {batch_id!r}", param="batch_id",
                       code="batch_not_found")
    return rec


async def get_batch(request: web.Request) -> web.Response:
    return json_response(_batch(request, _service(request)).to_openai())


async def list_batches(request: web.Request) -> web.Response:
    svc = _service(request)
    tenant = _tenant(request)
    after = request.query.get("after")
    if after is not None and svc.store.get_batch(tenant, after) is None:
        raise invalid(f"'after' names no batch of yours: {after!r}", "after")
    batches, more = svc.store.list_batches(tenant, _limit(request), after, _created(request))
    return json_response(_page([b.to_openai() for b in batches], more))


async def cancel_batch(request: web.Request) -> web.Response:
    svc = _service(request)
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


def upload_body_limit(request: web.Request) -> int | None:
    """The body limit of a file upload when the batch API is on; None for every other request
    (the server's own limit applies)."""
    svc = request.app.get(BATCH)
    if svc is None or request.path != "/v1/files" or request.method != "POST":
        return None
    return svc.limits.max_file_bytes + _CHUNK  # multipart framing around the file
