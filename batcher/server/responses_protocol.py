"""OpenAI's Responses API as a translation onto chat completions: the request's input items
become chat messages, the chat answer becomes a response object, and chat chunks become the
Responses stream's events.

Decisions (docs/agent-apis.md):
- `reasoning`: served only with a reasoning parser (`--reasoning-parser`): the think block is a
  `reasoning` output item, before the reply; `effort` and `summary` are accepted and echoed, not
  applied (the model thinks as its chat template has it). Without a parser, a `reasoning` with an
  effort or summary is a 400 naming it, as OpenAI answers for a model that does not reason.
  `reasoning` input items (earlier output sent back) are dropped, as chat templates drop
  earlier turns' reasoning.
- `instructions` apply to this turn only; `previous_response_id` brings the earlier turns (their
  input and output items), not their instructions, as OpenAI documents.
- Fields of the API this server cannot honour are a 400 naming them; unknown fields are ignored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from batcher.http.errors import invalid
from batcher.http.sse import sse_named
from batcher.server.bridge import ChunkEvent, new_id, read_chunk
from batcher.server.unsupported import Unsupported, refuse_fields

MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_RESPONSE_ID_CHARS = 128
log = logging.getLogger(__name__)

# Chat field -> the Responses field a client sent, for error messages.
NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format",
         "messages": "input"}


def _none_or_empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


def _no_reasoning(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and all(x is None for x in v.values()))


UNSUPPORTED: tuple[Unsupported, ...] = (
    Unsupported("reasoning", "the served model does not reason (no reasoning parser is "
                "configured)", _no_reasoning),
    Unsupported("background", "background responses are not supported",
                lambda v: v is None or v is False),
    Unsupported("truncation", "only 'disabled': input is never truncated",
                lambda v: v is None or v == "disabled"),
    Unsupported("include", "no additional output data is available", _none_or_empty),
    Unsupported("top_logprobs", "logprobs are not available on this route",
                lambda v: v is None or v == 0),
    Unsupported("max_tool_calls", "a limit on tool calls is not supported"),
    Unsupported("conversation", "conversations are not supported; use "
                "'previous_response_id'"),
    Unsupported("prompt", "reusable prompt templates are not supported"),
    Unsupported("service_tier", "only 'auto' or 'default'",
                lambda v: v is None or v in ("auto", "default")),
)


@dataclass(slots=True)
class ResponsesRequest:
    """A validated Responses request: the turn's new chat messages, what builds the chat body,
    and the fields a response object echoes."""

    model: str | None
    messages: list[dict[str, Any]]  # this turn's input as chat messages
    instructions: str | None
    previous_response_id: str | None
    store: bool
    stream: bool
    chat: dict[str, Any]  # the chat body but for its messages
    echo: dict[str, Any] = field(default_factory=dict)

    def chat_body(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completions body: instructions, earlier turns, this turn."""
        lead = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return dict(self.chat, messages=lead + history + self.messages)


def parse_request(body: dict[str, Any], reasoning: bool = False) -> ResponsesRequest:
    """Validate a Responses body. Raises ApiError(400) naming the field. `reasoning`: the
    server has a reasoning parser."""
    refuse_fields(body, tuple(r for r in UNSUPPORTED if not (reasoning
                                                           and r.field == "reasoning")))
    effort = body.get("reasoning")
    if effort is not None and not isinstance(effort, dict):
        raise invalid("'reasoning' must be an object", "reasoning", "invalid_type")
    model = body.get("model")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("'instructions' must be a string", "instructions", "invalid_type")
    prev = body.get("previous_response_id")
    if prev is not None and (not isinstance(prev, str) or not prev
                             or len(prev) > MAX_RESPONSE_ID_CHARS):
        raise invalid("'previous_response_id' must be a response id", "previous_response_id",
                      "invalid_type")
    store = _bool(body, "store", True)
    stream = _bool(body, "stream", False)
    messages = input_messages(body.get("input"))
    tools = _tools(body.get("tools"))
    chat: dict[str, Any] = {"stream": stream}
    if model is not None:
        chat["model"] = model
    if tools is not None:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice)
    for key in ("parallel_tool_calls", "temperature", "top_p", "user"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if stream:
        chat["stream_options"] = {"include_usage": True}
    metadata = _metadata(body.get("metadata"))
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": metadata, "parallel_tool_calls": body.get("parallel_tool_calls") is not
            False, "previous_response_id": prev, "store": store,
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": choice if choice is not None else "auto",
            "reasoning": {"effort": (effort or {}).get("effort"),
                          "summary": (effort or {}).get("summary")},
            "tools": body.get("tools") or [], "user": body.get("user")}
    return ResponsesRequest(model if isinstance(model, str) else None, messages, instructions,
                            prev, store, stream, chat, echo)


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"'{key}' must be a boolean", key, "invalid_type")
    return v


def _metadata(v: Any) -> dict[str, str]:
    """Up to 16 string pairs, as OpenAI allows; echoed and stored, never interpreted."""
    if v is None:
        return {}
    if not isinstance(v, dict) or len(v) > MAX_METADATA_KEYS or not all(
            isinstance(k, str) and isinstance(x, str) and len(k) <= MAX_METADATA_KEY_CHARS
            and len(x) <= MAX_METADATA_VALUE_CHARS for k, x in v.items()):
        raise invalid(f"'metadata' must map at most {MAX_METADATA_KEYS} keys of up to "
                      f"{MAX_METADATA_KEY_CHARS} characters to strings of up to "
                      f"{MAX_METADATA_VALUE_CHARS}", "metadata", "invalid_type")
    return v


def _tools(v: Any) -> list[dict[str, Any]] | None:
    """Function tools in chat's shape; any other kind of tool is a 400 naming it."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise invalid("'tools' must be a list", "tools", "invalid_type")
    out = []
    for i, t in enumerate(v):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise invalid(f"tools[{i}]: only function tools are supported, not "
                          f"{str(kind)[:64]!r}", "tools", "unsupported")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(v: Any) -> Any:
    if v in ("auto", "none", "required"):
        return v
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("name"), str):
        return {"type": "function", "function": {"name": v["name"]}}
    raise invalid("'tool_choice' must be 'auto', 'none', 'required' or "
                  "{'type': 'function', 'name': ...}", "tool_choice")


def _text_format(v: Any) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (the same grammar engine serves both)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid("'text' must be an object", "text", "invalid_type")
    if v.get("verbosity") not in (None, "medium"):
        raise invalid("'text.verbosity' is not supported: the served model has no verbosity "
                      "setting", "text.verbosity", "unsupported")
    fmt = v.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise invalid("'text.format.type' must be 'text', 'json_object' or 'json_schema'",
                  "text.format")


# input items -> chat messages ---------------------------------------------------------------
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")


def input_messages(v: Any) -> list[dict[str, Any]]:
    """`input` (a string, or a list of message, function_call and function_call_output items)
    as chat messages. Consecutive function calls join one assistant message, after any text the
    assistant said just before them."""
    if isinstance(v, str):
        return [{"role": "user", "content": v}]
    if not isinstance(v, list) or not v:
        raise invalid("'input' must be a string or a non-empty list of items", "input",
                      "invalid_type")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(v):
        if not isinstance(item, dict):
            raise invalid(f"input[{i}] must be an object", "input", "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise invalid(f"input[{i}].role must be one of {list(ROLES)}", "input")
            out.append({"role": role, "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            name, args, cid = item.get("name"), item.get("arguments"), item.get("call_id")
            if not (isinstance(name, str) and isinstance(args, str) and isinstance(cid, str)):
                raise invalid(f"input[{i}]: a function_call needs 'call_id', 'name' and "
                              "'arguments' (strings)", "input")
            call = {"id": cid, "type": "function",
                    "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            cid, output = item.get("call_id"), item.get("output")
            if not isinstance(cid, str):
                raise invalid(f"input[{i}]: a function_call_output needs 'call_id'", "input")
            out.append({"role": "tool", "tool_call_id": cid, "content": _text(output, i)})
        elif kind == "reasoning":
            continue  # earlier reasoning, sent back: chat templates drop it from the prompt
        else:
            raise invalid(f"input[{i}]: items of type {str(kind)[:64]!r} are not supported "
                          "(messages, function_call, function_call_output and reasoning are)",
                          "input", "unsupported")
    return out


def _text(content: Any, i: int) -> str:
    """A message's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"input[{i}].content must be a string or a list of text parts", "input",
                      "invalid_type")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise invalid(f"input[{i}].content: only text parts are supported, not "
                          f"{str(kind)[:64]!r}", "input", "unsupported")
        texts.append(part["text"])
    return "".join(texts)


# chat answer -> response object ---------------------------------------------------------------
def usage_body(usage: dict[str, Any]) -> dict[str, Any]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text)] if status == "completed" else []}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed"
            else []}


def call_item(item_id: str, call_id: str, name: str, arguments: str,
              status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response_object(rid: str, created: float, model: str, echo: dict[str, Any],
                    output: list[dict[str, Any]], finish: str | None,
                    usage: dict[str, Any] | None, status: str | None = None) -> dict[str, Any]:
    """A response object. `finish` (the chat finish_reason) sets its status: "length" is
    `incomplete` for `max_output_tokens`, anything else `completed`."""
    if status is None:
        status = "incomplete" if finish == "length" else "completed"
    return {"id": rid, "object": "response", "created_at": int(created), "status": status,
            "background": False, "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if status == "incomplete" else None),
            "model": model, "output": output, "truncation": "disabled", **echo,
            "usage": usage_body(usage) if usage is not None else None}


def output_from_chat(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as output items: its reasoning, its text, then its calls."""
    out = []
    if message.get("reasoning_content"):
        out.append(reasoning_item(new_id("rs_"), message["reasoning_content"]))
    if message.get("content"):
        out.append(message_item(new_id("msg_"), message["content"]))
    for call in message.get("tool_calls") or ():
        fn = call["function"]
        out.append(call_item(new_id("fc_"), call["id"], fn["name"], fn["arguments"]))
    return out


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the chat messages a later turn continues from."""
    msgs: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(p["text"] for p in item["content"] if p["type"] == "output_text")
            msgs.append({"role": "assistant", "content": text})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
    return msgs


def from_chat(answer: dict[str, Any], rid: str, echo: dict[str, Any]) -> dict[str, Any]:
    """A whole chat answer as a response object."""
    choice = answer["choices"][0]
    out = response_object(rid, answer["created"], answer["model"], echo,
                           output_from_chat(choice["message"]), choice["finish_reason"],
                           answer["usage"])
    if "timings" in answer:
        out["timings"] = answer["timings"]
    return out


# chat chunks -> stream events ------------------------------------------------------------------
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

    def _open_reasoning(self) -> bytes:
        self.thought = []
        self._thinking = reasoning_item(new_id("rs_"), "", "in_progress")
        return self._ev("response.output_item.added", output_index=len(self.output),
                        item=self._thinking)

    def _close_reasoning(self) -> bytes:
        if self.thought is None:
            return b""
        text, self.thought = "".join(self.thought), None
        item_id, idx = self._thinking["id"], len(self.output)
        item = reasoning_item(item_id, text)
        self.output.append(item)
        return (self._ev("response.reasoning_text.done", item_id=item_id, output_index=idx,
                         content_index=0, text=text)
                + self._ev("response.output_item.done", output_index=idx, item=item))

    def _item(self) -> dict[str, Any]:
        return self._message

    def _open_message(self) -> bytes:
        self.text = []
        self._message = message_item(new_id("msg_"), "", "in_progress")
        idx = len(self.output)
        return (self._ev("response.output_item.added", output_index=idx, item=self._message)
                + self._ev("response.content_part.added", item_id=self._message["id"],
                           output_index=idx, content_index=0, part=text_part("")))

    def _close_message(self) -> bytes:
        if self.text is None:
            return b""
        text, self.text = "".join(self.text), None
        item_id, idx = self._message["id"], len(self.output)
        item = message_item(item_id, text)
        self.output.append(item)
        return (self._ev("response.output_text.done", item_id=item_id, output_index=idx,
                         content_index=0, text=text, logprobs=[])
                + self._ev("response.content_part.done", item_id=item_id, output_index=idx,
                           content_index=0, part=text_part(text))
                + self._ev("response.output_item.done", output_index=idx, item=item))

    def _call_index(self, index: int) -> int:
        return len(self.output) + sorted(self.calls).index(index)

    def _close_calls(self) -> bytes:
        out = b""
        for index in sorted(self.calls):
            item = dict(self.calls[index], status="completed")
            idx = len(self.output)
            self.output.append(item)
            out += (self._ev("response.function_call_arguments.done", item_id=item["id"],
                             output_index=idx, name=item["name"],
                             arguments=item["arguments"])
                    + self._ev("response.output_item.done", output_index=idx, item=item))
        self.calls = {}
        return out
