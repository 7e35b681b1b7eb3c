"""Batch input files: one JSON request per line, `{"custom_id", "method", "url", "body"}`.

Parsing checks every limit before any line runs: the line count, each line's size (a line past
`max_line_bytes` is never parsed: a few MB of `[]` would be hundreds of MB of Python objects) and
JSON nesting, unique `custom_id`s, `POST` to a supported endpoint, a JSON object body that does not
ask to stream. Problems name the 1-based line number, as OpenAI's batch `errors` do.

Files are read in blocks (`iter_lines`), never whole, and checked one line at a time
(`InputChecker`), so a caller can work through a large file in a worker thread a chunk at a
time.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import orjson

from batcher.structured.json_limits import MAX_JSON_DEPTH, too_deep

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_LINES = 50_000
MAX_CUSTOM_ID_CHARS = 512
# A line is at most one live request body; the default is smaller than the live endpoint's
# (`--max-body-bytes`) since a batch holds up to 50,000 of them.
MAX_LINE_BYTES = 1 << 20
# Problems reported per file: enough to fix a file, bounded so a broken upload cannot produce a
# huge error body.
MAX_PROBLEMS = 100
_READ_BYTES = 1 << 20


@dataclass(slots=True, frozen=True)
class InputLine:
    """One request of a batch; `index` is its 0-based position among the file's requests.

    `cost`: (prompt tokens, max output tokens) over all its choices, when known (the batch
    creation's validation counts them); `answer`: (status, output-file line) for a line that can
    never run, answered at creation."""

    index: int
    custom_id: str
    url: str
    body: dict[str, Any]
    cost: tuple[int, int] | None = None
    answer: tuple[int, bytes] | None = None


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


def iter_lines(f: IO[bytes], max_line_bytes: int = MAX_LINE_BYTES
               ) -> Iterator[tuple[int, bytes | None]]:
    """(1-based line number, the line's bytes) of a file read in blocks; None in place of a line
    longer than `max_line_bytes`, whose bytes are skipped rather than held."""
    lineno = 0
    tail = b""
    over = False  # the line being read is already too long
    while data := f.read(_READ_BYTES):
        parts = data.split(b"\n")
        for part in itertools.islice(parts, len(parts) - 1):
            lineno += 1
            if over or len(tail) + len(part) > max_line_bytes:
                yield lineno, None
            else:
                yield lineno, tail + part if tail else part
            tail, over = b"", False
        if not over:
            if len(tail) + len(parts[-1]) > max_line_bytes:
                tail, over = b"", True
            else:
                tail += parts[-1]
    if over or tail:
        yield lineno + 1, None if over else tail


class InputChecker:
    """Checks a file's lines one at a time, in order; `finish` adds what only the whole file
    shows. `endpoint`: every line's `url` must equal it (batch creation); None accepts any
    supported endpoint, one per file unless `one_endpoint` is False (the offline runner)."""

    def __init__(self, endpoint: str | None = None, max_lines: int = MAX_LINES,
                 one_endpoint: bool = True, max_line_bytes: int = MAX_LINE_BYTES,
                 max_depth: int = MAX_JSON_DEPTH):
        self.endpoint = endpoint
        self.max_lines = max_lines
        self.one_endpoint = one_endpoint
        self.max_line_bytes = max_line_bytes
        self.max_depth = max_depth
        self.count = 0  # requests (non-blank lines) seen
        self.accepted = 0
        self.problems: list[LineProblem] = []
        self._seen: set[str] = set()
        self._urls: set[str] = set()

    @property
    def too_many(self) -> bool:
        return self.count > self.max_lines

    def _bad(self, code: str, message: str, lineno: int | None, param: str | None = None
             ) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(LineProblem(code, message, lineno, param))

    def add(self, lineno: int, raw: bytes | None) -> InputLine | None:
        """The request on line `lineno` (None: blank, or a problem was recorded). `raw` None:
        the line was longer than the limit."""
        if raw is not None and not raw.strip():
            return None
        self.count += 1
        if self.too_many:
            return None  # only counted from here on: the file is refused for its size
        if raw is None:
            self._bad("line_too_large", f"the line is longer than {self.max_line_bytes} bytes "
                      "(the limit of one request in a batch)", lineno)
            return None
        try:
            item = orjson.loads(raw)
        except orjson.JSONDecodeError:
            self._bad("invalid_json", "the line is not valid JSON", lineno)
            return None
        if not isinstance(item, dict):
            self._bad("invalid_request", "the line must be a JSON object", lineno)
            return None
        if too_deep(item, self.max_depth, raw):
            self._bad("json_too_deep", "the line nests lists and objects more than "
                      f"{self.max_depth} levels deep", lineno)
            return None
        cid = item.get("custom_id")
        if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID_CHARS:
            self._bad("invalid_custom_id", "'custom_id' must be a string of "
                      f"1-{MAX_CUSTOM_ID_CHARS} characters", lineno, "custom_id")
            return None
        if cid in self._seen:
            self._bad("duplicate_custom_id", f"'custom_id' {cid!r} appears more than once",
                      lineno, "custom_id")
            return None
        self._seen.add(cid)
        if item.get("method", "POST") != "POST":
            self._bad("invalid_method", "'method' must be 'POST'", lineno, "method")
            return None
        url = item.get("url")
        if url not in ENDPOINTS:
            self._bad("invalid_url", f"'url' must be one of {list(ENDPOINTS)}", lineno, "url")
            return None
        if self.endpoint is not None and url != self.endpoint:
            self._bad("mismatched_url", f"'url' is {url} but the batch's endpoint is "
                      f"{self.endpoint}", lineno, "url")
            return None
        self._urls.add(url)
        body = item.get("body")
        if not isinstance(body, dict):
            self._bad("invalid_body", "'body' must be a JSON object", lineno, "body")
            return None
        if body.get("stream"):
            self._bad("invalid_body", "a batch request cannot stream", lineno, "body.stream")
            return None
        line = InputLine(self.accepted, cid, url, body)
        self.accepted += 1
        return line

    def finish(self) -> list[LineProblem]:
        """Every problem of the file (empty when it can run)."""
        if self.count == 0:
            return [LineProblem("empty_file", "the file has no requests")]
        if self.too_many:
            return [LineProblem("too_many_requests", f"the file has {self.count} requests; a "
                                f"batch takes at most {self.max_lines}")]
        if self.one_endpoint and len(self._urls) > 1:
            self._bad("mixed_urls", "all requests of a batch must use one endpoint; found "
                      f"{sorted(self._urls)}", None, "url")
        return self.problems


def parse_input(data: bytes, endpoint: str | None = None, max_lines: int = MAX_LINES,
                one_endpoint: bool = True, max_line_bytes: int = MAX_LINE_BYTES
                ) -> tuple[list[InputLine], list[LineProblem]]:
    """The requests of a JSONL file held in memory and what is wrong with it (empty when it can
    run); see `InputChecker`."""
    import io

    check = InputChecker(endpoint, max_lines, one_endpoint, max_line_bytes)
    lines = [ln for lineno, raw in iter_lines(io.BytesIO(data), max_line_bytes)
             if (ln := check.add(lineno, raw)) is not None]
    problems = check.finish()
    return ([] if check.too_many else lines), problems


def check_file(f: IO[bytes], max_lines: int = MAX_LINES, max_line_bytes: int = MAX_LINE_BYTES
               ) -> list[LineProblem]:
    """What is wrong with a batch input file (any one supported endpoint), reading it in blocks
    and holding no line past its check: for an upload, in a worker thread."""
    check = InputChecker(None, max_lines, True, max_line_bytes)
    for lineno, raw in iter_lines(f, max_line_bytes):
        check.add(lineno, raw)
    return check.finish()
