"""Tool-call formats, one small parser class each, chosen by name (`--tool-call-parser`):
`generic` (the default, for chat templates without a format of their own), `hermes`
(Qwen2.5/Qwen3, Hermes: `<tool_call>{json}</tool_call>`) and `llama3_json` (Llama 3.1-3.3)."""

from __future__ import annotations

from batcher.server.tool_parsers.base import ToolParser
from batcher.server.tool_parsers.generic import GenericParser
from batcher.server.tool_parsers.hermes import HermesParser
from batcher.server.tool_parsers.llama3 import Llama3JsonParser
from batcher.server.tool_parsers.spec import ToolSpec, parse_tools
from batcher.server.tool_parsers.stream import ToolStream

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (GenericParser, HermesParser, Llama3JsonParser)}
DEFAULT = GenericParser.name


def parser_names() -> list[str]:
    return list(PARSERS)


def get_parser(name: str, chat_template: str | None = None) -> ToolParser:
    """The parser called `name`. Raises ValueError naming the choices, or when a format of
    the template's own is asked of a template that does not render `tools`."""
    cls = PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {parser_names()}")
    if cls.native and "tools" not in (chat_template or ""):
        raise ValueError(f"tool call parser {name!r} needs a chat template that renders "
                         "'tools'; this model's does not (use 'generic')")
    return cls()


__all__ = ["DEFAULT", "PARSERS", "ToolParser", "ToolSpec", "ToolStream", "get_parser",
           "parse_tools", "parser_names"]
