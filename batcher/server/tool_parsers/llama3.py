"""The Llama 3.1-3.3 JSON format: the answer is a call object
`{"name": ..., "parameters": {...}}` (several separated by `;`), optionally after the
`<|python_tag|>` marker; any other answer is a reply. The chat template lists the tools."""

from __future__ import annotations

from typing import Any

from batcher.server.tool_parsers.base import ToolParser, decode_calls, held_prefix
from batcher.server.tool_parsers.spec import ToolSpec

TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    arguments_key = "parameters"

    def forced_lark(self, call: str, many: bool) -> str:
        more = ' ("; " call)*' if many else ""
        return f"start: call{more}\ncall: {call}\n"

    def parse_calls(self, text: str, spec: ToolSpec
                    ) -> tuple[str | None, list[dict[str, Any]] | None]:
        body = text.lstrip()
        body = body.removeprefix(TAG)
        if not spec.active or not body.lstrip().startswith("{"):
            return text, None
        calls = decode_calls(body, 0, ";")
        return (None, calls) if calls else (text, None)

    def split(self, pending: str, spec: ToolSpec, started: bool, final: bool
              ) -> tuple[str, int | None]:
        if not spec.active or started:
            return pending, None
        head = pending.lstrip()
        if head.startswith(("{", TAG)):
            return "", 0
        if not final and (not head or held_prefix(head, TAG) == len(head)):
            return "", None  # may still open a call
        return pending, None
