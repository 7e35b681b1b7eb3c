"""What a tool-call format must provide: how the chat shows the tools and earlier calls, the
grammar an answer follows (if any), and how calls are read back, whole or streamed."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from batcher.http.errors import invalid
from batcher.server.tool_parsers.spec import (
    ToolSpec,
    call_arguments,
    closed_objects,
    openai_call,
)
from batcher.server.tool_parsers.stream import ToolStream, collect_calls
from batcher.structured.grammars import lark_grammar


class ToolParser:
    """One format. `native` formats are the model's own: the chat template receives `tools`
    and renders earlier calls itself; the answer is free unless a call is forced, then
    grammar-constrained to the format. Subclasses set `name` and override the hooks."""

    name: ClassVar[str]
    native: ClassVar[bool] = True

    def render(self, messages: Any, spec: ToolSpec) -> Any:
        """The chat as the template sees it. Raises ApiError(400) on a malformed call."""
        if not isinstance(messages, list):
            return messages  # the tokenizer reports the shape
        out = []
        for i, msg in enumerate(messages):
            if isinstance(msg, dict) and msg.get("role") == "assistant" and msg.get("tool_calls"):
                # Templates write `arguments | tojson`: they want the object, not its text.
                calls = [{"type": "function", "function": {"name": n, "arguments": a}}
                         for n, a in call_arguments(msg["tool_calls"], i)]
                msg = {"role": "assistant", "content": msg.get("content") or "",
                       "tool_calls": calls}
            out.append(msg)
        return out

    def template_tools(self, spec: ToolSpec) -> list[dict[str, Any]] | None:
        """The `tools` the chat template receives; None for the generic format, whose earlier
        calls are text. A native one with no tools offered still renders earlier calls."""
        if not self.native:
            return None
        if not spec.active:
            return []
        return [{"type": "function", "function": t} for t in spec.offered]

    def grammar(self, spec: ToolSpec) -> str | None:
        """The answer's grammar: native formats constrain only a forced call."""
        if not spec.forced:
            return None
        schema = json.dumps({"anyOf": [self.call_schema(t) for t in spec.offered]})
        try:
            return lark_grammar(self.forced_lark(f"%json {schema}", spec.many), "tools")
        except ValueError as exc:
            raise invalid(str(exc), "tools") from None

    def call_schema(self, tool: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": tool["name"]},
                                                 self.arguments_key: closed_objects(
                                                     tool["parameters"])},
                "required": ["name", self.arguments_key], "additionalProperties": False}

    arguments_key: ClassVar[str] = "arguments"

    def forced_lark(self, call: str, many: bool) -> str:
        """A Lark grammar of one call (`many`: one or more) in this format; `call` is the
        rule body of one call object."""
        raise NotImplementedError

    def parse(self, text: str, spec: ToolSpec) -> tuple[str | None, list[dict[str, Any]] | None]:
        """A whole answer: (reply text or None, its calls in OpenAI's shape or None). An answer
        that had to be a call (`spec.forced`) but was cut short (`max_tokens`, a stop
        sequence) stays a call: its arguments as far as they got, as the stream sent them,
        never the format's raw text as a reply."""
        content, calls = self.parse_calls(text, spec)
        if calls is None and spec.forced:
            cut = collect_calls(self.stream(spec).feed(text)[1])
            if not cut and spec.choice != "required":  # cut before the named tool's name
                cut = [openai_call(spec.choice, "")]
            if cut:
                return None, cut
        return content, calls

    def parse_calls(self, text: str, spec: ToolSpec
                    ) -> tuple[str | None, list[dict[str, Any]] | None]:
        """`parse` for a complete answer in this format."""
        raise NotImplementedError

    def split(self, pending: str, spec: ToolSpec, started: bool, final: bool
              ) -> tuple[str, int | None]:
        """Streaming: of reply text not yet shown, (what can be shown now, where the call
        region begins or None). `started`: some reply text went out already; `final`: no more
        text comes."""
        raise NotImplementedError

    def stream(self, spec: ToolSpec) -> ToolStream:
        return ToolStream(self, spec)


def decode_calls(text: str, start: int, skip: str = "") -> list[dict[str, Any]] | None:
    """Call objects from `start` on, separated by white space and the characters in `skip`,
    in OpenAI's shape; None when any is not a call object."""
    dec = json.JSONDecoder()
    calls = []
    i = start
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in skip):
            i += 1
        if i == len(text):
            return calls or None
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        call = as_call(obj)
        if call is None:
            return None
        calls.append(call)


def as_call(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return openai_call(obj["name"], args)


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that may begin `tag` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
