"""The Responses API's stream: a request's chat chunks as the Responses events, from
`response.created` to `response.completed` (or `.incomplete`, `.failed`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from batcher.http.sse import sse_named
from batcher.server.bridge import ChunkEvent, new_id, read_chunk
from batcher.server.responses_objects import (
    call_item,
    message_item,
    reasoning_item,
    response_object,
    text_part,
)

log = logging.getLogger(__name__)


class ResponsesEvents:
    """The Responses stream of one request, from its chat chunks: `response.created` and
    `response.in_progress`, then per output item `output_item.added`, its reasoning text,
    content part or arguments deltas and their `.done` events, `output_item.done`, and at the end
    `response.completed` (or `.incomplete`, `.failed`). Every event carries `sequence_number`.
    `done` holds the final response object once the stream completed. With `on_done` (which
    stores it), the final event waits for `end()`: `on_done` runs there first, so a client that
    saw `response.completed` finds the response stored; its failure is logged, never breaks a
    stream whose content was sent."""

    def __init__(self, rid: str, model: str, echo: dict[str, Any],
                 on_done: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.rid, self.model, self.echo = rid, model, echo
        self.on_done = on_done
        self.created = clock()
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.text: list[str] | None = None  # the open message item's text
        self.thought: list[str] | None = None  # the open reasoning item's text
        self.calls: dict[int, dict[str, Any]] = {}  # chat call index -> its open item
        self.finish: str | None = None
        self.done: dict[str, Any] | None = None
        self._final = b""  # the final event, held for end() while on_done has to run
        self._message: dict[str, Any] = {}  # the open message item
        self._thinking: dict[str, Any] = {}  # the open reasoning item

    def _ev(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_named(kind, payload)

    def _response(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self.rid, self.created, self.model, self.echo,
                               list(self.output) if status != "in_progress" else [],
                               self.finish, usage, status)

    def chunk(self, payload: dict[str, Any]) -> bytes:
        return b"".join(self.feed(e) for e in read_chunk(payload))

    async def end(self) -> bytes:
        final, self._final = self._final, b""
        if final and self.on_done is not None and self.done is not None:
            try:
                await self.on_done(self.done)
            except Exception:  # noqa: BLE001 (the content was sent; the store is logged)
                log.exception("response %s: storing it failed", self.rid)
        return final

    def feed(self, e: ChunkEvent) -> bytes:
        if e.kind == "start":
            return (self._ev("response.created", response=self._response("in_progress"))
                    + self._ev("response.in_progress", response=self._response("in_progress")))
        if e.kind == "reasoning":
            out = b"" if self.thought is not None else self._open_reasoning()
            self.thought.append(e.text)  # type: ignore[union-attr]
            return out + self._ev("response.reasoning_text.delta",
                                  item_id=self._thinking["id"], output_index=len(self.output),
                                  content_index=0, delta=e.text)
        if e.kind == "text":
            out = self._close_reasoning()
            out += b"" if self.text is not None else self._open_message()
            self.text.append(e.text)  # type: ignore[union-attr]
            return out + self._ev("response.output_text.delta", item_id=self._item()["id"],
                                  output_index=len(self.output), content_index=0,
                                  delta=e.text, logprobs=[])
        if e.kind == "call":
            out = self._close_reasoning() + self._close_message()
            item = call_item(new_id("fc_"), e.call_id, e.name, "", "in_progress")
            self.calls[e.index] = item
            return out + self._ev("response.output_item.added",
                                  output_index=len(self.output) + len(self.calls) - 1,
                                  item=item)
        if e.kind == "args":
            item = self.calls[e.index]
            item["arguments"] += e.text
            return self._ev("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=self._call_index(e.index), delta=e.text)
        if e.kind == "finish":
            self.finish = e.reason
            return self._close_reasoning() + self._close_message() + self._close_calls()
        if e.kind == "usage":
            status = "incomplete" if self.finish == "length" else "completed"
            self.done = self._response(status, e.usage)
            final = self._ev(f"response.{status}", response=self.done)
            if self.on_done is None:
                return final
            self._final = final
            return b""
        # An error ends the stream: the response failed, with what it had produced.
        failed = self._close_reasoning() + self._close_message() + self._close_calls()
        resp = self._response("failed")
        resp["error"] = {"code": "server_error", "message": e.text}
        return failed + self._ev("response.failed", response=resp)

    def _added(self, item: dict[str, Any], *parts: tuple[str, dict[str, Any]]) -> bytes:
        """`output_item.added` for an item opening at the end of the output, then its other
        opening events (`parts`: event type and fields, each given the item's id and index)."""
        idx = len(self.output)
        return self._ev("response.output_item.added", output_index=idx, item=item) + b"".join(
            self._ev(kind, item_id=item["id"], output_index=idx, **fields)
            for kind, fields in parts)

    def _finished(self, item: dict[str, Any], *parts: tuple[str, dict[str, Any]]) -> bytes:
        """A finished item appended to the output: its closing events (`parts`, as `_added`
        has them), then `output_item.done`."""
        idx = len(self.output)
        self.output.append(item)
        return b"".join(self._ev(kind, item_id=item["id"], output_index=idx, **fields)
                        for kind, fields in parts) + self._ev(
            "response.output_item.done", output_index=idx, item=item)

    def _open_reasoning(self) -> bytes:
        self.thought = []
        self._thinking = reasoning_item(new_id("rs_"), "", "in_progress")
        return self._added(self._thinking)

    def _close_reasoning(self) -> bytes:
        if self.thought is None:
            return b""
        text, self.thought = "".join(self.thought), None
        return self._finished(reasoning_item(self._thinking["id"], text),
                              ("response.reasoning_text.done", {"content_index": 0,
                                                                "text": text}))

    def _item(self) -> dict[str, Any]:
        return self._message

    def _open_message(self) -> bytes:
        self.text = []
        self._message = message_item(new_id("msg_"), "", "in_progress")
        return self._added(self._message, ("response.content_part.added",
                                           {"content_index": 0, "part": text_part("")}))

    def _close_message(self) -> bytes:
        if self.text is None:
            return b""
        text, self.text = "".join(self.text), None
        return self._finished(
            message_item(self._message["id"], text),
            ("response.output_text.done", {"content_index": 0, "text": text, "logprobs": []}),
            ("response.content_part.done", {"content_index": 0, "part": text_part(text)}))

    def _call_index(self, index: int) -> int:
        return len(self.output) + sorted(self.calls).index(index)

    def _close_calls(self) -> bytes:
        out = b""
        for index in sorted(self.calls):
            item = dict(self.calls[index], status="completed")
            out += self._finished(item, ("response.function_call_arguments.done",
                                         {"name": item["name"], "arguments": item["arguments"]}))
        self.calls = {}
        return out
