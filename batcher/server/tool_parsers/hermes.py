"""The Hermes format, which Qwen2.5/Qwen3 and Hermes models use: each call is
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, after any reply text. The chat
template lists the tools and renders earlier calls; text after the calls is dropped."""

from __future__ import annotations

import json
from typing import Any

from batcher.server.tool_parsers.base import ToolParser, as_call, held_prefix
from batcher.server.tool_parsers.spec import ToolSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def forced_lark(self, call: str, many: bool) -> str:
        block = f'"{OPEN}\\n" call "\\n{CLOSE}"'
        more = f' ("\\n" {block})*' if many else ""
        return f"start: {block}{more}\ncall: {call}\n"

    def parse_calls(self, text: str, spec: ToolSpec
                    ) -> tuple[str | None, list[dict[str, Any]] | None]:
        first = text.find(OPEN)
        if not spec.active or first < 0:
            return text, None
        calls = []
        for block in text[first:].split(OPEN)[1:]:
            body = block.split(CLOSE, 1)[0].strip()
            try:
                call = as_call(json.loads(body))
            except ValueError:
                call = None
            if call is None:
                return text, None  # a broken or cut call: the client sees the text
            calls.append(call)
        return text[:first].strip() or None, calls

    def split(self, pending: str, spec: ToolSpec, started: bool, final: bool
              ) -> tuple[str, int | None]:
        if not spec.active:
            return pending, None
        at = pending.find(OPEN)
        if at >= 0:
            return pending[:at], at
        if final:
            return pending, None
        return pending[:len(pending) - held_prefix(pending, OPEN)], None
