"""A batch's input lines as the store's `lines` rows, built in any thread before they are staged
(`BatchStore.stage_lines`); a line nobody tokenized is sized roughly from its body."""

from __future__ import annotations

from typing import Any

import orjson

from batcher.batch.jsonl import InputLine

# Rows of staged lines inserted per transaction: each commit is short, so answers recorded
# meanwhile wait for at most one.
STAGE_ROWS = 1000


def line_rows(batch_id: str, lines: list[InputLine]) -> list[tuple[Any, ...]]:
    """The `lines` rows of a batch's lines, for `stage_lines`: any thread may build them (a line
    answered at creation is stored done, with its output-file line). Lines with no `cost` are
    sized roughly from their body (`rough_cost`)."""
    rows = []
    for ln in lines:
        prompt, out = ln.cost or rough_cost(ln.body)
        status, output = ln.answer or (None, None)
        # An answered line's body is never read again: not stored.
        body = orjson.dumps(ln.body) if output is None else b"{}"
        rows.append((batch_id, ln.index, ln.custom_id, body,
                     "pending" if output is None else "done", status, output, prompt, out))
    return rows


def rough_cost(body: dict[str, Any]) -> tuple[int, int]:
    """(prompt, max output) tokens of a body nobody tokenized: about four characters of JSON
    per token, the output as asked (16 when not, or not a sane number)."""
    text = body.get("messages") or body.get("prompt") or body.get("input") or ""
    out = body.get("max_completion_tokens") or body.get("max_tokens")
    return (max(1, len(str(text)) // 4),
            out if isinstance(out, int) and 0 < out <= 1 << 20 else 16)
