"""Streaming tool calls: text in, OpenAI `tool_calls` deltas out, token by token.

A call is a JSON object `{"name": ..., "arguments" | "parameters": {...}}`. Once its name and
the arguments key are in, the call's first delta goes out (`index`, `id`, `type`,
`function.name`); then every character of the arguments value goes out as it arrives, as
`function.arguments` fragments, so a client's concatenation is the arguments' JSON text. An
object that puts its arguments before its name is sent whole when it closes.

Which text is a reply and where calls begin is the format's business (`ToolParser.split`);
inside the call region, everything between objects (tags, brackets, separators) is skipped.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

from batcher.server.tool_parsers.spec import ToolSpec, call_id


class Splitter(Protocol):
    """What the stream needs of a format (`ToolParser.split`): of reply text not yet shown, what
    can be shown now and where the call region begins."""

    def split(self, pending: str, spec: ToolSpec, started: bool, final: bool
              ) -> tuple[str, int | None]: ...


HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
# A head is looked for in this many leading characters of an object (a tool's name is at most 64
# characters, each at most 6 escaped, plus the keys and spacing); an object whose head is not
# there is sent whole when it closes. Each token then costs a bounded match, not a rescan of
# everything generated so far.
HEAD_MAX_CHARS = 512


def delta(index: int, name: str | None = None, arguments: str = "") -> dict[str, Any]:
    """A `tool_calls` delta: the first of a call names it, later ones carry arguments."""
    if name is None:
        return {"index": index, "function": {"arguments": arguments}}
    return {"index": index, "id": call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def collect_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`tool_calls` deltas joined into whole calls (each call's arguments fragments in order),
    as a client joins a stream."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if "id" in d:
            calls[d["index"]] = {"id": d["id"], "type": "function",
                                 "function": dict(d["function"])}
        elif d["index"] in calls:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


class _Call:
    """One call object being streamed: head (until the name and arguments key), args (the
    arguments value, forwarded as it comes), tail (to the object's closing brace)."""

    __slots__ = ("buf", "depth", "esc", "in_str", "index", "scanned", "started", "state")

    def __init__(self, index: int) -> None:
        self.index = index
        self.buf = ""
        self.state = "head"
        self.depth = 0
        self.in_str = self.esc = False
        self.started = False
        self.scanned = 0  # head: how much of `buf` the brace scan has read

    def feed(self, text: str) -> tuple[list[dict[str, Any]], str | None]:
        """(deltas, the text after the object once it closed, else None)."""
        out: list[dict[str, Any]] = []
        if self.state == "head":
            self.buf += text
            m = HEAD.match(self.buf, 0, HEAD_MAX_CHARS)
            if m is None:
                end = self._head_end()
                if end is None:
                    return out, None
                return self._whole(self.buf[:end]), self.buf[end:]
            out.append(delta(self.index, json.loads(f'"{m.group(1)}"')))
            self.state, text = "args", self.buf[m.end():]
            self.depth, self.in_str, self.esc = 0, False, False  # the head scan's, not the args'
        if self.state == "args":
            frag, rest = self._args(text)
            if frag:
                out.append(delta(self.index, arguments=frag))
            if rest is None:
                return out, None
            self.state, self.depth, text = "tail", 1, rest
        return out, self._tail(text)

    def _head_end(self) -> int | None:
        """The index just past the object that opens `buf` once it closed, else None; the
        scan resumes where the previous feed stopped, so a long object is read once in all,
        not once per token."""
        end = self._close(self.buf, self.scanned)
        if end is None:
            self.scanned = len(self.buf)
        return end

    def _close(self, text: str, start: int) -> int | None:
        """The index just past the bracket in `text` (from `start`) that brings the depth back
        to 0, else None; brackets inside JSON strings do not count."""
        for j in range(start, len(text)):
            ch = text[j]
            if self._in_string(ch):
                continue
            if ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return j + 1
        return None

    def _in_string(self, ch: str) -> bool:
        """Advance the JSON string state by `ch`; whether `ch` belongs to a string (its quotes
        included), so a bracket in it is no structure."""
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
            return True
        if ch == '"':
            self.in_str = True
            return True
        return False

    def _whole(self, text: str) -> list[dict[str, Any]]:
        try:
            obj = json.loads(text)
        except ValueError:
            return []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return []
        args = obj.get("arguments", obj.get("parameters", {}))
        return [delta(self.index, obj["name"], args if isinstance(args, str) else
                      json.dumps(args))]

    def _args(self, text: str) -> tuple[str, str | None]:
        """The part of `text` in the arguments value, and what follows it once it ended."""
        for j, ch in enumerate(text):
            if not self.started:
                if ch.isspace():
                    continue
                self.started = True
            was_in_str = self.in_str
            if self._in_string(ch):
                if was_in_str and not self.in_str and self.depth == 0:
                    return text[:j + 1], text[j + 1:]  # a string value ends here
                continue
            if ch in "{[":
                self.depth += 1
            elif ch in "}]" and self.depth > 0:
                self.depth -= 1
                if self.depth == 0:
                    return text[:j + 1], text[j + 1:]
            elif ch in ",}" and self.depth == 0:  # a bare scalar value ends before this
                return text[:j], text[j:]
        return text, None

    def _tail(self, text: str) -> str | None:
        end = self._close(text, 0)
        if end is None:
            return None
        self.state = "done"
        return text[end:]


class ToolStream:
    """One streamed choice: `feed` each text delta, `end` at the choice's end; both return
    (reply text to show now, `tool_calls` deltas)."""

    __slots__ = ("calls", "current", "parser", "pending", "region", "spec", "started")

    def __init__(self, parser: Splitter, spec: ToolSpec) -> None:
        self.parser = parser
        self.spec = spec
        self.pending = ""  # reply text held back while it may still open a call
        self.region = False  # inside the call region
        self.started = False  # some reply text went out
        self.calls = 0  # calls named so far
        self.current: _Call | None = None

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if not self.region:
            self.pending += text
            show, at = self.parser.split(self.pending, self.spec, self.started, final=False)
            if at is None:
                self.pending = self.pending[len(show):]
                self.started = self.started or bool(show)
                return show, []
            text, self.pending, self.region = self.pending[at:], "", True
            return show, self._calls(text)
        return "", self._calls(text)

    def end(self) -> tuple[str, list[dict[str, Any]]]:
        if self.region:
            if not self.calls and self.spec.forced and self.spec.choice != "required":
                # Cut before the named tool's name was out: still that tool's call.
                self.calls = 1
                return "", [delta(0, self.spec.choice)]
            return "", []
        show, _ = self.parser.split(self.pending, self.spec, self.started, final=True)
        self.pending = ""
        return show, []

    @property
    def called(self) -> bool:
        return self.calls > 0

    def _calls(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while text:
            if self.current is None:
                at = text.find("{")
                if at < 0:
                    return out
                self.current = _Call(self.calls)
                text = text[at:]
            deltas, rest = self.current.feed(text)
            # NOTE: counted once named: an object that is no call takes no index.
            self.calls += sum(1 for d in deltas if "id" in d)
            out += deltas
            if rest is None:
                return out
            self.current, text = None, rest
        return out
