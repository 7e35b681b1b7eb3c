"""Tool calling in a generic format, for chat templates without a tool format of their own (the
bundled model's among them).

The tools are described in a system message; a call is the JSON object
`{"name": <tool>, "arguments": {...}}` and nothing else. The answer is grammar-constrained: to a
call of one of the tools (`tool_choice: "required"`), to a call of the named tool, or to either a
call or a reply that does not start with `{` (`"auto"`); `"none"` leaves tools out entirely.
Earlier assistant `tool_calls` are rendered back as the same JSON, and `role: tool` messages as
the tool's result, so a conversation reads as the model wrote it.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from batcher.http.errors import invalid
from batcher.structured import MAX_GRAMMAR_CHARS, json_schema_grammar, lark_grammar

MAX_TOOLS = 64
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
INSTRUCTIONS = (
    "You can call these tools. To call one, answer with only a JSON object "
    '{"name": <tool name>, "arguments": <arguments object>} and nothing else. '
    "Otherwise answer the user normally.\nTools:\n")
REQUIRED = ("You must call one of these tools: answer with only a JSON object "
            '{"name": <tool name>, "arguments": <arguments object>}.\nTools:\n')


@dataclass(slots=True)
class ToolSpec:
    """The request's tools and how the answer may use them."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # the `function` objects
    choice: str = "auto"  # auto | required | none | the name of one tool

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """The answer must be a call."""
        return self.active and self.choice != "auto"


def parse_tools(body: dict[str, Any]) -> ToolSpec:
    """`tools`, `tool_choice`, `parallel_tool_calls`. Raises ApiError(400) naming the field."""
    raw = body.get("tools")
    spec = ToolSpec()
    if raw is not None:
        if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
            raise invalid(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools",
                          "invalid_type")
        names = set()
        for i, t in enumerate(raw):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
                raise invalid(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}",
                              "tools")
            name = fn.get("name")
            if not isinstance(name, str) or not NAME.fullmatch(name) or name in names:
                raise invalid(f"tools[{i}].function.name must be a unique name of 1-64 letters, "
                              "digits, '_' or '-'", "tools")
            params = fn.get("parameters", {"type": "object"})
            if not isinstance(params, dict):
                raise invalid(f"tools[{i}].function.parameters must be a JSON schema", "tools")
            desc = fn.get("description", "")
            if not isinstance(desc, str):
                raise invalid(f"tools[{i}].function.description must be a string", "tools")
            names.add(name)
            spec.tools.append({"name": name, "description": desc, "parameters": params})
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none", "required"):
        spec.choice = choice or "auto"
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        spec.choice = choice["function"]["name"]
        if spec.choice not in {t["name"] for t in spec.tools}:
            raise invalid(f"tool_choice names '{spec.choice[:64]}', which is not among 'tools'",
                          "tool_choice")
    else:
        raise invalid("'tool_choice' must be 'auto', 'none', 'required' or "
                      "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if spec.choice == "required" and not spec.tools:
        raise invalid("tool_choice 'required' needs 'tools'", "tool_choice")
    ptc = body.get("parallel_tool_calls")
    if ptc is not None and not isinstance(ptc, bool):
        raise invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls",
                      "invalid_type")
    return spec


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool["name"]},
                                             "arguments": tool["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_grammar(spec: ToolSpec) -> str | None:
    """The answer's grammar: a call (required, named) or a call or a reply (auto)."""
    if not spec.active:
        return None
    tools = spec.tools if spec.choice in ("auto", "required") else [
        t for t in spec.tools if t["name"] == spec.choice]
    schema = {"anyOf": [_call_schema(t) for t in tools]}
    try:
        if spec.forced:
            return json_schema_grammar(schema, "tools")
        text = json.dumps(schema)
        if len(text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"'tools' are longer than {MAX_GRAMMAR_CHARS} characters")
        # A reply is anything that does not start a JSON object (or with white space, which
        # would let a call hide behind it).
        return lark_grammar(f"start: call | reply\ncall: %json {text}\n"
                            "reply: /[^{\\s][\\s\\S]*/\n", "tools")
    except ValueError as exc:
        raise invalid(str(exc), "tools") from None


def render_messages(messages: Any, spec: ToolSpec) -> Any:
    """The chat as the template sees it: tool instructions first, earlier calls as their JSON,
    tool results as `tool` messages. Raises ApiError(400) on a malformed call or result."""
    if not isinstance(messages, list):
        return messages  # the tokenizer reports the shape
    out: list[Any] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            out.append(msg)
            continue
        calls = msg.get("tool_calls")
        if msg.get("role") == "assistant" and calls:
            out.append({"role": "assistant", "content": _calls_text(calls, i)})
        elif msg.get("role") == "tool":
            content = msg.get("content")
            if not isinstance(content, (str, list)):
                raise invalid(f"messages[{i}].content must be the tool's result", "messages")
            out.append({"role": "tool", "content": content})
        else:
            out.append(msg)
    if spec.active:
        listing = "\n".join(json.dumps(t) for t in spec.tools if spec.choice in (
            "auto", "required", t["name"]))
        intro = (REQUIRED if spec.forced else INSTRUCTIONS) + listing
        if out and isinstance(out[0], dict) and out[0].get("role") in ("system", "developer") \
                and isinstance(out[0].get("content"), str):
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + intro}
        else:
            out.insert(0, {"role": "system", "content": intro})
    return out


def _calls_text(calls: Any, i: int) -> str:
    if not isinstance(calls, list):
        raise invalid(f"messages[{i}].tool_calls must be a list", "messages")
    texts = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"messages[{i}].tool_calls items need function.name", "messages")
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise invalid(f"messages[{i}].tool_calls arguments must be JSON", "messages"
                          ) from None
        texts.append(json.dumps({"name": fn["name"], "arguments": parsed}))
    return "\n".join(texts)


def parse_call(text: str, spec: ToolSpec) -> list[dict[str, Any]] | None:
    """The answer's tool calls in OpenAI's shape, or None when it is a reply."""
    if not spec.active or not text.lstrip().startswith("{"):
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        return None  # cut short (max_tokens): not a call a client could run
    names = {t["name"] for t in spec.tools}
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    return [{"id": "call_" + secrets.token_hex(12), "type": "function",
             "function": {"name": obj["name"],
                          "arguments": json.dumps(obj.get("arguments", {}))}}]


class CallBuffer:
    """One streamed choice's text, held back while it may still be a tool call: a forced call
    always, an `auto` answer until its first character shows it is a reply."""

    __slots__ = ("held", "replying", "spec")

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.held: list[str] = []
        self.replying = not spec.active

    def feed(self, text: str) -> str:
        """The text to show now."""
        if self.replying:
            return text
        self.held.append(text)
        joined = "".join(self.held)
        if not self.spec.forced and joined.strip() and not joined.lstrip().startswith("{"):
            self.replying, self.held = True, []
            return joined
        return ""

    def end(self) -> tuple[str, list[dict[str, Any]] | None]:
        """At the choice's end: (text still to show, its tool calls or None)."""
        if self.replying:
            return "", None
        joined = "".join(self.held)
        calls = parse_call(joined, self.spec)
        return ("" if calls else joined), calls
