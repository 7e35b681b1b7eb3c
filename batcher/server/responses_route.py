"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API on the chat
completions path (`responses_request.py`, `responses_objects.py` and `responses_events.py`
translate, `responses_store.py` keeps stored ones)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from batcher.http.errors import ApiError
from batcher.http.responses import json_response
from batcher.server.appkeys import GATEWAY
from batcher.server.bridge import TURN, BridgeHandler, new_id, require_object
from batcher.server.chunk_sink import ChunkSink
from batcher.server.gateway import Gateway, Job
from batcher.server.protocol import GenerationSpec
from batcher.server.responses_events import ResponsesEvents
from batcher.server.responses_objects import from_chat, output_messages
from batcher.server.responses_request import (
    MAX_RESPONSE_ID_CHARS,
    NAMES,
    ResponsesRequest,
    parse_request,
)
from batcher.server.responses_store import ResponseStore, StoreConfig, open_store

RESPONSES = web.AppKey("responses", "ResponsesHandler")
# The stored previous response, looked up (off the event loop) before the body is parsed.
PREVIOUS = "responses_previous"


@dataclass(slots=True)
class Turn:
    """One request's state between the handler's hooks."""

    req: ResponsesRequest
    history: list[dict[str, Any]]  # earlier turns, from the stored previous response
    rid: str
    tenant: str


def not_found(rid: str, param: str) -> ApiError:
    return ApiError(404, f"no response '{rid}' is stored for this key", param=param,
                    code="response_not_found")


class ResponsesHandler(BridgeHandler):
    names = NAMES

    def __init__(self, gw: Gateway, store: ResponseStore) -> None:
        super().__init__(gw)
        self.store = store

    async def load(self, request: web.Request, body: Any) -> None:
        prev = body.get("previous_response_id") if isinstance(body, dict) else None
        if isinstance(prev, str) and 0 < len(prev) <= MAX_RESPONSE_ID_CHARS:
            request[PREVIOUS] = await asyncio.to_thread(self.store.get,
                                                        request["tenant"].name, prev)

    def parse(self, request: web.Request, body: Any) -> GenerationSpec:
        req = parse_request(require_object(body), self.gw.reasoning is not None)
        tenant = request["tenant"].name
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = request.get(PREVIOUS)
            if prev is None:
                raise not_found(req.previous_response_id, "previous_response_id")
            history = prev.messages
        spec = super().parse(request, req.chat_body(history))
        request[TURN] = Turn(req, history, new_id("resp_"), tenant)
        return spec

    async def _keep(self, turn: Turn, response: dict[str, Any]) -> None:
        """Store the response (SQLite and large JSON: in a worker thread)."""
        kept = {k: v for k, v in response.items() if k != "timings"}
        await asyncio.to_thread(self.store.put, turn.tenant, turn.rid, kept, turn.history
                                + turn.req.messages + output_messages(response["output"]))

    async def shape(self, request: web.Request, answer: dict[str, Any]) -> dict[str, Any]:
        turn: Turn = request[TURN]
        response = from_chat(answer, turn.rid, turn.req.echo)
        if turn.req.store:
            await self._keep(turn, response)
        return response

    def sink(self, request: web.Request, spec: GenerationSpec, job: Job) -> ChunkSink:
        turn: Turn = request[TURN]
        return ResponsesEvents(turn.rid, spec.model, turn.req.echo, on_done=(
            (lambda response: self._keep(turn, response)) if turn.req.store else None))


async def create(request: web.Request) -> web.StreamResponse:
    return await request.app[RESPONSES](request)


async def retrieve(request: web.Request) -> web.Response:
    rid = request.match_info["id"]
    stored = await asyncio.to_thread(request.app[RESPONSES].store.get,
                                     request["tenant"].name, rid)
    if stored is None:
        raise not_found(rid, "response_id")
    return json_response(stored.response)


async def delete(request: web.Request) -> web.Response:
    rid = request.match_info["id"]
    if not await asyncio.to_thread(request.app[RESPONSES].store.delete,
                                   request["tenant"].name, rid):
        raise not_found(rid, "response_id")
    return json_response({"id": rid, "object": "response", "deleted": True})


def install(app: web.Application, cfg: StoreConfig, **route_kw: Any) -> None:
    """The routes, and the store for as long as the app runs (opened after the gateway)."""

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        store = open_store(cfg.data_dir, cfg.retention)
        app[RESPONSES] = ResponsesHandler(app[GATEWAY], store)
        try:
            yield
        finally:
            store.close()

    app.cleanup_ctx.append(lifetime)
    app.router.add_post("/v1/responses", create, **route_kw)
    app.router.add_get("/v1/responses/{id}", retrieve, **route_kw)
    app.router.add_delete("/v1/responses/{id}", delete, **route_kw)
