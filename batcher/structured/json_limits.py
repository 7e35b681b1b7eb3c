"""Bounds on JSON a client sends: nesting depth and the JSON text inside strings.

Python code that walks a document recurses once per level (chat templates, schema compilers,
`repr`, `json.dumps`), and runs out of stack near 1,000 levels: a RecursionError, which would be
a 500 for what is the client's fault. Every body is checked once when it is read
(`batcher.http.listener.read_json`); JSON carried inside a string (a schema, tool-call arguments)
goes through `loads_bounded`. Pure Python, no dependencies beyond orjson.
"""

from __future__ import annotations

from typing import Any

import orjson

# Deep enough for any real request (a JSON schema nested 30 objects deep is 60 levels), far
# below what recursive code can walk.
MAX_JSON_DEPTH = 64


def too_deep(obj: Any, limit: int = MAX_JSON_DEPTH, raw: bytes | str | None = None) -> bool:
    """Whether `obj` nests lists and objects more than `limit` levels deep. With `raw` (the text
    it was parsed from), a document with fewer than `limit` brackets is passed without a walk."""
    if not isinstance(obj, dict | list):
        return False
    if raw is not None:
        opens = (raw.count(b"[") + raw.count(b"{") if isinstance(raw, bytes)
                 else raw.count("[") + raw.count("{"))
        if opens <= limit:
            return False
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def loads_bounded(text: str | bytes, limit: int = MAX_JSON_DEPTH) -> Any:
    """`text` parsed as JSON; ValueError when it is not JSON or nests more than `limit` deep."""
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    if too_deep(obj, limit, text):
        raise ValueError(f"nested more than {limit} levels deep")
    return obj
