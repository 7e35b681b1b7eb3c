"""`POST /v1/files`: a multipart upload streamed to disk, its declared length checked against the
file limit and the tenant's storage quota before it is read and its actual bytes while it is
written; the file then checked as a batch input (line count, line sizes, shapes and endpoints) in
a worker thread, a chunk at a time, before the store keeps it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from batcher.batch.api_state import BATCH, BatchLimits, BatchService, batch_service, tenant_of
from batcher.batch.jsonl import LineProblem, check_file
from batcher.http.errors import ApiError, invalid
from batcher.http.responses import json_response
from batcher.http.text import excerpt, safe_filename

PURPOSES = ("batch",)
# A form field other than the file ('purpose'): read whole, so bounded (the body's own limit is
# the file's).
MAX_FIELD_BYTES = 1024
# `expires_after.seconds` a client may ask for, as OpenAI's API bounds it (1 hour to 30 days).
MIN_EXPIRES_AFTER_S = 3600
MAX_EXPIRES_AFTER_S = 30 * 86400
_CHUNK = 1 << 16


def _problems(problems: list[LineProblem]) -> ApiError:
    first = problems[0]
    where = f"line {first.line}: " if first.line else ""
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    return invalid(f"the file is not a valid batch input: {where}{first.message}{more}",
                   "file", first.code)


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
    svc = batch_service(request)
    tenant = tenant_of(request)
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


def upload_body_limit(request: web.Request) -> int | None:
    """The body limit of a file upload when the batch API is on; None for every other request
    (the server's own limit applies)."""
    svc = request.app.get(BATCH)
    if svc is None or request.path != "/v1/files" or request.method != "POST":
        return None
    return svc.limits.max_file_bytes + _CHUNK  # multipart framing around the file
