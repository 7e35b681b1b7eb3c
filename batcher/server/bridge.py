"""What the routes that speak another API (OpenAI Responses, Anthropic Messages) share: they
translate a request into a chat completions body and run it through `GenerationHandler` (the
same gateway steps: validation, tenant budget, admission, latency anatomy, access log), then
translate the chat answer or its chunks back.

`read_chunk` turns one chat chunk into a few plain events, so each API's stream translator reads
what happened (text, a tool call named, arguments, the finish, usage, an error) and never the
chat chunk's layout. Errors the chat path raises name chat fields; `renamed` names the field the
client actually sent instead.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any, ClassVar

from aiohttp import web

from batcher.http.errors import ApiError, invalid
from batcher.structured.json_limits import loads_bounded
from batcher.server.openai_routes import GenerationHandler
from batcher.server.timing import RequestTiming

# Per-request state of a translating route, kept on the aiohttp request (handlers are shared).
TURN = "bridge_turn"


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


@dataclass(slots=True)
class ChunkEvent:
    """One thing a chat chunk says. `kind`: start | reasoning | text | call | args | finish |
    usage | error. `index` is the tool call's index among the answer's calls."""

    kind: str
    text: str = ""
    index: int = 0
    call_id: str = ""
    name: str = ""
    reason: str | None = None  # finish: the chat finish_reason; error: the error code
    stop: str | None = None  # finish: the stop string that matched
    usage: dict[str, Any] | None = None


def read_chunk(chunk: dict[str, Any]) -> list[ChunkEvent]:
    """The events of one chat completion chunk (or of the error body a stream ends with)."""
    err = chunk.get("error")
    if isinstance(err, dict):
        return [ChunkEvent("error", text=str(err.get("message") or "the request failed"),
                           reason=err.get("code"))]
    out: list[ChunkEvent] = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("role"):
            out.append(ChunkEvent("start"))
        # A reasoning parser's think block comes before the reply (`reasoning.py`).
        if delta.get("reasoning_content"):
            out.append(ChunkEvent("reasoning", text=delta["reasoning_content"]))
        if delta.get("content"):
            out.append(ChunkEvent("text", text=delta["content"]))
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            if "id" in call:
                out.append(ChunkEvent("call", index=call["index"], call_id=call["id"],
                                      name=fn.get("name", "")))
            if fn.get("arguments"):
                out.append(ChunkEvent("args", text=fn["arguments"], index=call["index"]))
        if choice.get("finish_reason") is not None:
            out.append(ChunkEvent("finish", reason=choice["finish_reason"],
                                  stop=choice.get("stop_reason")))
    if chunk.get("usage") is not None and not chunk.get("choices"):
        out.append(ChunkEvent("usage", usage=chunk["usage"]))
    return out


def renamed(err: ApiError, names: dict[str, str]) -> ApiError:
    """`err` naming the client's fields: its `param` and any quoted chat field in its message
    (`'max_tokens'` -> `'max_output_tokens'`)."""
    if err.param in names:
        err.param = names[err.param]
    if names:
        pattern = re.compile("'(" + "|".join(map(re.escape, names)) + ")'")
        err.message = pattern.sub(lambda m: f"'{names[m.group(1)]}'", err.message)
    return err


def json_arguments(text: str, index: int) -> dict[str, Any]:
    """A call's arguments text as the object the other APIs carry; a call cut short (by
    max tokens) keeps its text under `_raw` rather than failing the whole answer."""
    try:
        obj = loads_bounded(text) if text.strip() else {}
    except ValueError:
        return {"_raw": text}
    return obj if isinstance(obj, dict) else {"_value": obj}


class BridgeHandler(GenerationHandler):
    """A chat completions handler whose request and answer are another API's. Subclasses set
    `names` (chat field -> the API's field, for error messages) and override the hooks
    (`parse`, `shape`, `sink`)."""

    names: ClassVar[dict[str, str]] = {}

    def __init__(self, gw: Any) -> None:
        super().__init__(gw, chat=True)

    async def _handle(self, request: web.Request, timing: RequestTiming) -> web.StreamResponse:
        try:
            return await super()._handle(request, timing)
        except ApiError as err:
            raise renamed(err, self.names) from None


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    return body
