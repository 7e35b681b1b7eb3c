"""Anthropic's Messages API as a translation onto chat completions: content blocks become chat
messages, the chat answer becomes a message with content blocks, chat chunks become Anthropic's
stream events, and errors take Anthropic's shape (`{"type": "error", "error": {...}}`).

Decisions (docs/agent-apis.md): with a reasoning parser (`--reasoning-parser`) the think block
is a `thinking` content block before the reply, whatever `thinking` asks (the model thinks as its
chat template has it; `budget_tokens` is not enforced); without one, `thinking` other than
disabled is a 400. `thinking` blocks sent back in assistant messages are dropped, as chat
templates drop earlier reasoning. Image, document and server-tool blocks are a 400 naming the field; `cache_control`
on blocks is accepted and ignored (the prefix cache needs no marks); `metadata.user_id` is
accepted and not used. Unknown fields are ignored, as elsewhere. The error shape is
`batcher.http.anthropic_errors` (replica and router share it).
"""

from __future__ import annotations

import json
from typing import Any

from batcher.http.anthropic_errors import error_body
from batcher.http.errors import invalid
from batcher.http.sse import sse_named
from batcher.server.bridge import ChunkEvent, json_arguments, read_chunk
from batcher.server.unsupported import Unsupported, refuse_fields

# Anthropic's own limit is higher; chat's is 4 stop strings.
MAX_STOP_SEQUENCES = 4
NAMES = {"stop": "stop_sequences", "response_format": "output_config.format"}

UNSUPPORTED: tuple[Unsupported, ...] = (
    Unsupported("thinking", "the served model does not reason",
                lambda v: v is None or (isinstance(v, dict) and v.get("type") == "disabled")),
    Unsupported("mcp_servers", "MCP servers are not supported",
                lambda v: v is None or v == []),
    Unsupported("container", "containers are not supported"),
    Unsupported("context_management", "context management is not supported"),
    Unsupported("service_tier", "only 'auto' or 'standard_only'",
                lambda v: v is None or v in ("auto", "standard_only")),
)

# Chat finish_reason -> Anthropic stop_reason ("abort": the owner cancelled it).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "abort": "end_turn"}
def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


# request -> chat body ---------------------------------------------------------------------------
def chat_body(body: dict[str, Any], count_only: bool = False,
              reasoning: bool = False) -> dict[str, Any]:
    """The chat completions body of a Messages request. Raises ApiError(400) naming the field.
    `count_only`: for count_tokens, where `max_tokens` is not sent; `reasoning`: the server has
    a reasoning parser."""
    refuse_fields(body, tuple(r for r in UNSUPPORTED if not (reasoning
                                                           and r.field == "thinking")))
    thinking = body.get("thinking")
    if thinking is not None and not isinstance(thinking, dict):
        raise invalid("'thinking' must be an object", "thinking", "invalid_type")
    chat: dict[str, Any] = {}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    max_tokens = body.get("max_tokens")
    if max_tokens is None and not count_only:
        raise invalid("'max_tokens' is required", "max_tokens", "missing")
    if not count_only:
        chat["max_tokens"] = max_tokens
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("'messages' must be a non-empty list", "messages", "invalid_type")
    system = _system(body.get("system"))
    chat["messages"] = ([{"role": "system", "content": system}] if system else []) + [
        m for i, msg in enumerate(msgs) for m in _message(msg, i)]
    tools = body.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"], parallel = _tool_choice(choice)
        if parallel is False:
            chat["parallel_tool_calls"] = False
    temperature = body.get("temperature")
    if temperature is not None:
        if (isinstance(temperature, bool) or not isinstance(temperature, int | float)
                or not 0.0 <= temperature <= 1.0):
            raise invalid("'temperature' must be a number between 0 and 1", "temperature")
        chat["temperature"] = temperature
    for key in ("top_p", "top_k"):
        if body.get(key) is not None:
            chat[key] = body[key]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES:
            raise invalid(f"'stop_sequences' must be a list of at most {MAX_STOP_SEQUENCES} "
                          "strings", "stop_sequences", "invalid_type")
        if stops:
            chat["stop"] = stops
    fmt = _output_format(body.get("output_config"))
    if fmt is not None:
        chat["response_format"] = fmt
    md = body.get("metadata")
    if md is not None and not isinstance(md, dict):
        raise invalid("'metadata' must be an object", "metadata", "invalid_type")
    stream = body.get("stream")
    if stream is not None:
        if not isinstance(stream, bool):
            raise invalid("'stream' must be a boolean", "stream", "invalid_type")
        chat["stream"] = stream
        if stream:
            chat["stream_options"] = {"include_usage": True}
    return chat


def _output_format(v: Any) -> dict[str, Any] | None:
    """`output_config.format` (a JSON schema) as chat's `response_format`: the same grammar
    engine constrains the answer."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid("'output_config' must be an object", "output_config", "invalid_type")
    if v.get("effort") is not None:
        raise invalid("'output_config.effort' is not supported: the served model has no effort "
                      "setting", "output_config.effort", "unsupported")
    fmt = v.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(
            fmt.get("schema"), dict):
        raise invalid("'output_config.format' must be {'type': 'json_schema', 'schema': {...}}",
                      "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _system(v: Any) -> str:
    if v is None or isinstance(v, str):
        return v or ""
    if isinstance(v, list):
        return "".join(_text_block(b, "system") for b in v)
    raise invalid("'system' must be a string or a list of text blocks", "system",
                  "invalid_type")


def _text_block(b: Any, where: str) -> str:
    if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
        kind = b.get("type") if isinstance(b, dict) else None
        raise invalid(f"{where}: only text blocks are supported here, not {str(kind)[:64]!r}",
                      where.split("[")[0], "unsupported")
    return b["text"]


def _message(msg: Any, i: int) -> list[dict[str, Any]]:
    """One Messages message as chat messages: an assistant's text and tool_use blocks become
    one message with `tool_calls`; a user's tool_result blocks become `tool` messages, ahead
    of any text of the same message."""
    if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
        raise invalid(f"messages[{i}].role must be 'user' or 'assistant'", "messages")
    role, content = msg["role"], msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"messages[{i}].content must be a string or a list of blocks",
                      "messages", "invalid_type")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "text":
            texts.append(_text_block(b, where))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise invalid(f"{where}: a tool_use block needs 'id' and 'name'", "messages")
            calls.append({"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise invalid(f"{where}: a tool_result block needs 'tool_use_id'", "messages")
            out = b.get("content", "")
            text = out if isinstance(out, str) else "".join(
                _text_block(x, where) for x in (out if isinstance(out, list) else [out]))
            if b.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning, sent back: chat templates drop it from the prompt
        else:
            raise invalid(f"{where}: {str(kind)[:64]!r} blocks are not supported in "
                          f"{role} messages", "messages", "unsupported")
    if role == "assistant":
        out_msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            out_msg["tool_calls"] = calls
        return [out_msg]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts else [])


def _tools(v: Any) -> list[dict[str, Any]]:
    if not isinstance(v, list):
        raise invalid("'tools' must be a list", "tools", "invalid_type")
    out = []
    for i, t in enumerate(v):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom") or (
                "input_schema" not in t):
            kind = t.get("type") if isinstance(t, dict) else None
            raise invalid(f"tools[{i}]: only client tools with 'input_schema' are supported, "
                          f"not {str(kind)[:64]!r}", "tools", "unsupported")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(v: Any) -> tuple[Any, bool | None]:
    """Chat's tool_choice, and whether parallel calls are allowed (None: the default)."""
    kind = v.get("type") if isinstance(v, dict) else None
    parallel = None if not isinstance(v, dict) or v.get("disable_parallel_tool_use") is None \
        else not v["disable_parallel_tool_use"]
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(v.get("name"), str):
        return {"type": "function", "function": {"name": v["name"]}}, parallel
    raise invalid("'tool_choice' must be {'type': 'auto' | 'any' | 'none'} or "
                  "{'type': 'tool', 'name': ...}", "tool_choice")


# chat answer -> message ----------------------------------------------------------------------
def stop_fields(finish: str | None, stop: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat finish."""
    if finish == "stop" and stop is not None:
        return "stop_sequence", stop
    return STOP_REASONS.get(finish or "stop", "end_turn"), None


def usage_body(usage: dict[str, Any]) -> dict[str, Any]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def from_chat(answer: dict[str, Any], msg_id: str) -> dict[str, Any]:
    """A whole chat answer as a Messages message."""
    choice = answer["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"],
                        "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for i, call in enumerate(message.get("tool_calls") or ()):
        fn = call["function"]
        content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn["name"],
                        "input": json_arguments(fn["arguments"], i)})
    reason, seq = stop_fields(choice["finish_reason"], choice.get("stop_reason"))
    out = {"id": msg_id, "type": "message", "role": "assistant", "model": answer["model"],
           "content": content, "stop_reason": reason, "stop_sequence": seq,
           "usage": usage_body(answer["usage"])}
    if "timings" in answer:
        out["timings"] = answer["timings"]
    return out


# chat chunks -> stream events ------------------------------------------------------------------
class MessagesEvents:
    """Anthropic's stream of one request, from its chat chunks: `message_start`, `ping`, per
    content block `content_block_start`, its `thinking_delta`, `text_delta` or `input_json_delta`
    deltas and
    `content_block_stop`, then `message_delta` (stop_reason, usage) and `message_stop`. An
    engine failure or deadline mid-stream is an `error` event."""

    def __init__(self, msg_id: str, model: str, prompt_tokens: int) -> None:
        self.msg_id, self.model, self.prompt_tokens = msg_id, model, prompt_tokens
        self.block = -1  # index of the open block; -1 before the first
        self.open: str | None = None  # the open block's type
        self.calls: dict[int, int] = {}  # chat call index -> block index
        self.stop: tuple[str, str | None] = ("end_turn", None)

    def chunk(self, payload: dict[str, Any]) -> bytes:
        return b"".join(self.feed(e) for e in read_chunk(payload))

    async def end(self) -> bytes:
        return b""

    def feed(self, e: ChunkEvent) -> bytes:
        if e.kind == "start":
            message = {"id": self.msg_id, "type": "message", "role": "assistant",
                       "model": self.model, "content": [], "stop_reason": None,
                       "stop_sequence": None,
                       "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}
            return (sse_named("message_start", {"type": "message_start", "message": message})
                    + sse_named("ping", {"type": "ping"}))
        if e.kind == "reasoning":
            out = b"" if self.open == "thinking" else self._start(
                {"type": "thinking", "thinking": "", "signature": ""})
            return out + self._delta({"type": "thinking_delta", "thinking": e.text})
        if e.kind == "text":
            out = b"" if self.open == "text" else self._start({"type": "text", "text": ""})
            return out + self._delta({"type": "text_delta", "text": e.text})
        if e.kind == "call":
            out = self._start({"type": "tool_use", "id": tool_use_id(e.call_id),
                               "name": e.name, "input": {}})
            self.calls[e.index] = self.block
            return out
        if e.kind == "args":
            # To the call's own block: a later call's block may have opened since.
            return self._delta({"type": "input_json_delta", "partial_json": e.text},
                               self.calls.get(e.index, self.block))
        if e.kind == "finish":
            self.stop = stop_fields(e.reason, e.stop)
            return self._stop()
        if e.kind == "usage":
            assert e.usage is not None
            delta = {"type": "message_delta",
                     "delta": {"stop_reason": self.stop[0], "stop_sequence": self.stop[1]},
                     "usage": {"output_tokens": e.usage["completion_tokens"]}}
            return (sse_named("message_delta", delta)
                    + sse_named("message_stop", {"type": "message_stop"}))
        status = 504 if e.reason == "deadline_exceeded" else 503
        return self._stop() + sse_named("error", error_body(status, e.text))

    def _start(self, block: dict[str, Any]) -> bytes:
        out = self._stop()
        self.block += 1
        self.open = block["type"]
        return out + sse_named("content_block_start", {"type": "content_block_start",
                                                       "index": self.block,
                                                       "content_block": block})

    def _delta(self, delta: dict[str, Any], index: int | None = None) -> bytes:
        return sse_named("content_block_delta", {"type": "content_block_delta",
                                                 "index": self.block if index is None
                                                 else index, "delta": delta})

    def _stop(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return sse_named("content_block_stop", {"type": "content_block_stop",
                                                "index": self.block})
