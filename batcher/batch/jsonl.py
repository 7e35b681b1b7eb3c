"""Batch input files: one JSON request per line, `{"custom_id", "method", "url", "body"}`.

Parsing checks every limit before any line runs: the line count, each line's size, unique
`custom_id`s, `POST` to a supported endpoint, a JSON object body that does not ask to stream.
Problems name the 1-based line number, as OpenAI's batch `errors` do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_LINES = 50_000
MAX_CUSTOM_ID_CHARS = 512
# Problems reported per file: enough to fix a file, bounded so a broken upload cannot produce a
# huge error body.
MAX_PROBLEMS = 100


@dataclass(slots=True, frozen=True)
class InputLine:
    """One request of a batch; `index` is its 0-based position among the file's requests."""

    index: int
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(slots=True, frozen=True)
class LineProblem:
    """Why a line cannot run: OpenAI's batch error item (`line` is 1-based, None for the file)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param,
                "line": self.line}


def parse_input(data: bytes, endpoint: str | None = None, max_lines: int = MAX_LINES,
                one_endpoint: bool = True) -> tuple[list[InputLine], list[LineProblem]]:
    """The requests of a JSONL file and what is wrong with it (empty when it can run).

    `endpoint`: every line's `url` must equal it (batch creation); None accepts any supported
    endpoint, one per file unless `one_endpoint` is False (the offline runner)."""
    lines: list[InputLine] = []
    problems: list[LineProblem] = []
    seen: set[str] = set()
    urls: set[str] = set()

    def bad(code: str, message: str, lineno: int | None, param: str | None = None) -> None:
        if len(problems) < MAX_PROBLEMS:
            problems.append(LineProblem(code, message, lineno, param))

    raw_lines = data.split(b"\n")
    count = sum(1 for raw in raw_lines if raw.strip())
    if count == 0:
        return [], [LineProblem("empty_file", "the file has no requests")]
    if count > max_lines:
        return [], [LineProblem("too_many_requests",
                                f"the file has {count} requests; a batch takes at most "
                                f"{max_lines}")]
    for lineno, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            item = orjson.loads(raw)
        except orjson.JSONDecodeError:
            bad("invalid_json", "the line is not valid JSON", lineno)
            continue
        if not isinstance(item, dict):
            bad("invalid_request", "the line must be a JSON object", lineno)
            continue
        cid = item.get("custom_id")
        if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID_CHARS:
            bad("invalid_custom_id", f"'custom_id' must be a string of 1-{MAX_CUSTOM_ID_CHARS} "
                "characters", lineno, "custom_id")
            continue
        if cid in seen:
            bad("duplicate_custom_id", f"'custom_id' {cid!r} appears more than once", lineno,
                "custom_id")
            continue
        seen.add(cid)
        if item.get("method", "POST") != "POST":
            bad("invalid_method", "'method' must be 'POST'", lineno, "method")
            continue
        url = item.get("url")
        if url not in ENDPOINTS:
            bad("invalid_url", f"'url' must be one of {list(ENDPOINTS)}", lineno, "url")
            continue
        if endpoint is not None and url != endpoint:
            bad("mismatched_url", f"'url' is {url} but the batch's endpoint is {endpoint}",
                lineno, "url")
            continue
        urls.add(url)
        body = item.get("body")
        if not isinstance(body, dict):
            bad("invalid_body", "'body' must be a JSON object", lineno, "body")
            continue
        if body.get("stream"):
            bad("invalid_body", "a batch request cannot stream", lineno, "body.stream")
            continue
        lines.append(InputLine(len(lines), cid, url, body))
    if one_endpoint and len(urls) > 1:
        bad("mixed_urls", f"all requests of a batch must use one endpoint; found {sorted(urls)}",
            None, "url")
    return lines, problems
