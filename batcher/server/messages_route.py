"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat
completions path (`messages_protocol.py` translates). Errors on these routes take Anthropic's
shape (the app's middleware reshapes them, `reshape_error`); `x-api-key` authenticates as
`Authorization: Bearer` does (`auth.py`); `anthropic-version` is accepted and not read."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from batcher.http.anthropic_errors import PREFIX
from batcher.http.errors import ApiError
from batcher.http.responses import json_response
from batcher.server.appkeys import GATEWAY
from batcher.server.bridge import TURN, BridgeHandler, new_id, renamed, require_object
from batcher.server.chunk_sink import ChunkSink
from batcher.server.gateway import Job
from batcher.server.messages_protocol import NAMES, MessagesEvents, chat_body, from_chat
from batcher.server.protocol import GenerationSpec

MESSAGES = web.AppKey("messages", "MessagesHandler")


class MessagesHandler(BridgeHandler):
    names = NAMES

    def parse(self, request: web.Request, body: Any) -> GenerationSpec:
        spec = super().parse(request, chat_body(require_object(body),
                                                reasoning=self.gw.reasoning is not None))
        request[TURN] = new_id("msg_")
        return spec

    async def shape(self, request: web.Request, answer: dict[str, Any]) -> dict[str, Any]:
        return from_chat(answer, request[TURN])

    def sink(self, request: web.Request, spec: GenerationSpec, job: Job) -> ChunkSink:
        return MessagesEvents(request[TURN], spec.model, len(job.requests[0].prompt_token_ids))

    async def count_tokens(self, request: web.Request) -> web.Response:
        """The prompt's tokens as the model sees it (system, messages, tools), nothing run."""
        try:
            body = chat_body(require_object(await self.gw.read_request(request)),
                             count_only=True, reasoning=self.gw.reasoning is not None)
            body["max_tokens"] = 1
            spec = super().parse(request, body)
            prompts = await self.gw.tokenize(spec, request["tenant"])
        except ApiError as err:
            self.gw.note_refusal(request, err)
            raise renamed(err, self.names) from None
        return json_response({"input_tokens": len(prompts[0])})


async def create(request: web.Request) -> web.StreamResponse:
    return await request.app[MESSAGES](request)


async def count_tokens(request: web.Request) -> web.Response:
    return await request.app[MESSAGES].count_tokens(request)


def install(app: web.Application, **route_kw: Any) -> None:
    async def lifetime(app: web.Application):  # type: ignore[no-untyped-def]
        app[MESSAGES] = MessagesHandler(app[GATEWAY])
        yield

    app.cleanup_ctx.append(lifetime)
    app.router.add_post(PREFIX, create, **route_kw)
    app.router.add_post(PREFIX + "/count_tokens", count_tokens, **route_kw)
