"""A Responses API request as a chat completions body: the body validated, its input items as
chat messages, the fields a response object echoes. The response object is built in
`responses_objects.py`, the stream's events in `responses_events.py`.

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

from dataclasses import dataclass, field
from typing import Any

from batcher.http.errors import bool_field, invalid
from batcher.server.unsupported import Unsupported, refuse_fields

MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_RESPONSE_ID_CHARS = 128

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
    store = bool_field(body, "store", True)
    stream = bool_field(body, "stream", False)
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
