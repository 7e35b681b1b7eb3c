"""A file's bytes through the router: an upload streamed to the replica with the most headroom
that serves the batch API (cut off at the router's upload limit), and a file's content streamed
back from the replica holding it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from batcher.fleet.router import batch_ids
from batcher.fleet.router.batch_replicas import (
    PROXY,
    Unreachable,
    call_headers,
    owner,
    passed_on,
    quoted,
    unavailable,
)
from batcher.http.errors import ApiError, invalid
from batcher.http.responses import json_response

STREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_read=60.0)
UPLOAD_CANDIDATES = 3
_CHUNK = 1 << 16


async def upload_file(request: web.Request) -> web.StreamResponse:
    proxy = request.app[PROXY]
    limit = proxy.ctx.cfg.max_upload_bytes
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, f"the upload is {request.content_length} bytes; uploads are "
                       f"limited to {limit} bytes", code="file_too_large")
    if not request.content_type.startswith("multipart/"):
        raise invalid("upload a file as multipart/form-data with 'file' and 'purpose' fields",
                      None, "invalid_content_type")
    headers = call_headers(request)
    target = None
    asked = proxy.upload_order()[:UPLOAD_CANDIDATES]
    disabled = 0  # candidates that said they have no batch API (not merely did not answer)
    for rep in asked:
        with contextlib.suppress(Unreachable):
            if await proxy.serves_batches(rep, headers):
                target = rep
                break
            disabled += proxy._capable.get(rep.replica_id, (True, 0.0))[0] is False
    if target is None:
        if asked and disabled == len(asked):
            raise ApiError(404, "no replica behind this router serves the batch API (start "
                           "replicas with --data-dir)", code="batch_api_disabled")
        raise ApiError(503, "no replica that serves the batch API is ready", code="no_replica",
                       retry_after=2)
    headers["Content-Type"] = request.headers["Content-Type"]
    if request.content_length is not None:
        headers["Content-Length"] = str(request.content_length)
    assert proxy.ctx.session is not None
    body_in = _Limited(request, limit)
    try:
        async with proxy.ctx.session.post(target.url + "/v1/files", headers=headers,
                                          data=body_in.chunks(),
                                          timeout=STREAM_TIMEOUT) as resp:
            raw = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError, _TooLarge):
        if body_in.too_large:
            raise _too_large(limit) from None
        raise ApiError(503, "the upload did not reach a replica; send it again",
                       code="replica_unavailable", retry_after=2) from None
    if body_in.too_large:
        raise _too_large(limit)
    body = _json(raw)
    if status != 200:
        return passed_on(status, body)
    return json_response(batch_ids.outward(body, target.replica_id))


class _TooLarge(Exception):
    pass


class _Limited:
    """The request body, passed on as it arrives; an upload past `limit` is cut off there
    (whatever the replica then answers, the caller gets the 413)."""

    def __init__(self, request: web.Request, limit: int):
        self.request = request
        self.limit = limit
        self.too_large = False

    async def chunks(self) -> AsyncIterator[bytes]:
        size = 0
        while chunk := await self.request.content.read(_CHUNK):
            size += len(chunk)
            if size > self.limit:
                self.too_large = True
                raise _TooLarge
            yield chunk


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"uploads are limited to {limit} bytes", param="file",
                    code="file_too_large", headers={"Connection": "close"})


def _json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


async def file_content(request: web.Request) -> web.StreamResponse:
    rep, inner = owner(request, "file")
    ctx = request.app[PROXY].ctx
    assert ctx.session is not None
    url = f"{rep.url}/v1/files/{quoted(inner)}/content"
    out: web.StreamResponse | None = None
    try:
        async with ctx.session.get(url, headers=call_headers(request),
                                   timeout=STREAM_TIMEOUT) as resp:
            if resp.status != 200:
                return passed_on(resp.status, _json(await resp.read()))
            out = web.StreamResponse(headers={
                "Content-Type": resp.headers.get("Content-Type", "application/jsonl"),
                "X-Request-Id": request["request_id"]})
            if resp.content_length is not None:
                out.content_length = resp.content_length
            await out.prepare(request)
            async for chunk in resp.content.iter_chunked(_CHUNK):
                await out.write(chunk)
            await out.write_eof()
            return out
    except (aiohttp.ClientError, TimeoutError):
        if out is not None and out.prepared:
            raise  # mid-download: the connection ends, the client sees a short body
        raise unavailable(f"file {request.match_info['file_id']!r}") from None
