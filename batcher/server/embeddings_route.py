"""POST /v1/embeddings through the size-or-timeout `Flusher`: a list input becomes several items
in the batcher and one response."""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any

from aiohttp import web

from batcher.flusher.flusher import Closed, Overloaded
from batcher.http.errors import ApiError, invalid
from batcher.http.listener import read_json
from batcher.http.responses import json_response
from batcher.core.request_registry import DuplicateRequestId
from batcher.server.appkeys import GATEWAY

MAX_INPUTS = 2048


def _inputs(body: object) -> tuple[str, list[str], str]:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required", "model", "missing")
    raw = body.get("input")
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items or not all(isinstance(x, str) for x in items):
        raise invalid("'input' must be a string or a non-empty list of strings", "input",
                      "invalid_type")
    if len(items) > MAX_INPUTS:
        raise invalid(f"'input' takes at most {MAX_INPUTS} strings", "input")
    if any(not x for x in items):
        raise invalid("'input' strings must not be empty", "input")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise invalid("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    return model, items, fmt


async def handle(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    if gw.embedder is None:
        raise ApiError(404, "this server has no embedding model", code="model_not_found")
    model, items, fmt = _inputs(await read_json(request))
    if model != gw.embedder_name:
        raise invalid(f"model '{model[:64]}' is not served here; available: "
                      f"['{gw.embedder_name}']", "model", "model_not_found")
    batcher = gw.embedder
    if len(items) > batcher.max_queue:  # could never fit: a 503 would be retried for ever
        raise invalid(f"'input' takes at most {batcher.max_queue} strings on this server",
                      "input")
    if batcher.pending + len(items) > batcher.max_queue:  # the whole request or nothing
        raise ApiError(503, "the embedding queue is full", code="overloaded",
                       retry_after=batcher.retry_after())
    # Scoped by tenant, like generation requests: another tenant's ID is never a conflict.
    rid = f"{request['tenant'].name}:{request['request_id']}"
    tasks = [asyncio.ensure_future(batcher.submit(x, request_id=f"{rid}:{i}"))
             for i, x in enumerate(items)]
    try:
        vectors = await asyncio.gather(*tasks)
    except DuplicateRequestId:
        raise ApiError(409, f"request id '{request['request_id']}' is already in flight",
                       param="X-Request-Id", code="duplicate_request_id",
                       retry_after=1) from None
    except Overloaded as exc:
        raise ApiError(503, "the embedding queue is full", code="overloaded",
                       retry_after=exc.retry_after) from None
    except Closed:
        raise ApiError(503, "the server is shutting down", code="draining",
                       retry_after=1) from None
    except TimeoutError:
        raise ApiError(504, "the embedding request timed out", code="deadline_exceeded"
                       ) from None
    finally:
        for t in tasks:  # after a failure, the other inputs leave the queue unflushed
            t.cancel()
    tokens = sum(gw.embedder_tokens(items))
    return json_response(embedding_body(model, vectors, fmt, tokens))


def embedding_body(model: str, vectors: list[list[float]], fmt: str, tokens: int
                   ) -> dict[str, Any]:
    """The `/v1/embeddings` answer (also a batch line's): vectors as floats or base64 of
    little-endian float32, in input order."""
    data = []
    for i, vec in enumerate(vectors):
        emb = (base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
               if fmt == "base64" else vec)
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


