"""The generic format, for chat templates without a tool format of their own (the bundled
model's among them).

The tools are described in a system message; a call is the JSON object
`{"name": <tool>, "arguments": {...}}`, several calls a JSON array of them, and nothing else.
The answer is grammar-constrained: to calls of the tools (`tool_choice: "required"`), to a call
of the named tool, or to either calls or a reply that does not start with `{` or `[`
(`"auto"`); `parallel_tool_calls: false` allows one call only. Earlier assistant `tool_calls`
are rendered back as the same JSON, and `role: tool` messages as the tool's result, so a
conversation reads as the model wrote it.
"""

from __future__ import annotations

import json
from typing import Any

from batcher.http.errors import invalid
from batcher.server.tool_parsers.base import ToolParser, as_call
from batcher.server.tool_parsers.spec import ToolSpec, call_arguments
from batcher.structured.grammars import MAX_GRAMMAR_CHARS, json_schema_grammar, lark_grammar

INSTRUCTIONS = (
    "You can call these tools. To call one, answer with only a JSON object "
    '{"name": <tool name>, "arguments": <arguments object>} and nothing else. '
    "Otherwise answer the user normally.\nTools:\n")
REQUIRED = ("You must call one of these tools: answer with only a JSON object "
            '{"name": <tool name>, "arguments": <arguments object>}.\nTools:\n')
PARALLEL = "To call several tools at once, answer with a JSON array of such objects.\n"


class GenericParser(ToolParser):
    name = "generic"
    native = False

    def render(self, messages: Any, spec: ToolSpec) -> Any:
        if not isinstance(messages, list):
            return messages  # the tokenizer reports the shape
        out: list[Any] = []
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict):
                out.append(msg)
                continue
            calls = msg.get("tool_calls")
            if msg.get("role") == "assistant" and calls:
                objs = [{"name": n, "arguments": a} for n, a in call_arguments(calls, i)]
                text = json.dumps(objs[0] if len(objs) == 1 else objs)
                out.append({"role": "assistant", "content": text})
            elif msg.get("role") == "tool":
                content = msg.get("content")
                if not isinstance(content, (str, list)):
                    raise invalid(f"messages[{i}].content must be the tool's result", "messages")
                out.append({"role": "tool", "content": content})
            else:
                out.append(msg)
        if spec.active:
            listing = "\n".join(json.dumps(t) for t in spec.offered)
            intro = (REQUIRED if spec.forced else INSTRUCTIONS) + (
                PARALLEL if spec.many else "") + listing
            if out and isinstance(out[0], dict) and out[0].get("role") in (
                    "system", "developer") and isinstance(out[0].get("content"), str):
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + intro}
            else:
                out.insert(0, {"role": "system", "content": intro})
        return out

    def grammar(self, spec: ToolSpec) -> str | None:
        """Calls (required, named) or calls or a reply (auto)."""
        if not spec.active:
            return None
        one: dict[str, Any] = {"anyOf": [self.call_schema(t) for t in spec.offered]}
        schema = {"anyOf": [one, {"type": "array", "items": one, "minItems": 1}]} \
            if spec.many else one
        try:
            if spec.forced:
                return json_schema_grammar(schema, "tools")
            text = json.dumps(schema)
            if len(text) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"'tools' are longer than {MAX_GRAMMAR_CHARS} characters")
            # A reply is anything that does not start a JSON object or array (or with white
            # space, which would let a call hide behind it).
            return lark_grammar(f"start: call | reply\ncall: %json {text}\n"
                                "reply: /[^{\\[\\s][\\s\\S]*/\n", "tools")
        except ValueError as exc:
            raise invalid(str(exc), "tools") from None

    def parse_calls(self, text: str, spec: ToolSpec
                    ) -> tuple[str | None, list[dict[str, Any]] | None]:
        head = text.lstrip()[:1]
        if not spec.active or head not in ("{", "["):
            return text, None
        try:
            obj = json.loads(text)
        except ValueError:
            return text, None  # cut short (max_tokens): not a call a client could run
        items = obj if isinstance(obj, list) else [obj]
        names = {t["name"] for t in spec.offered}
        if not items or not all(isinstance(o, dict) and o.get("name") in names for o in items):
            return text, None
        return None, [c for c in map(as_call, items) if c is not None]

    def split(self, pending: str, spec: ToolSpec, started: bool, final: bool
              ) -> tuple[str, int | None]:
        if not spec.active or started:
            return pending, None
        if spec.forced:
            return "", 0
        head = pending.lstrip()[:1]
        if head in ("{", "["):
            return "", 0
        if not head and not final:
            return "", None  # white space only so far: a call may still follow
        return pending, None
