"""Client text made safe to echo: error messages quote at most a bounded, printable excerpt of
what a client sent (a 3 MB id must not come back as a 3 MB 404, a control character must not
reach a log line or a header), and stored filenames are printable and bounded.

- `excerpt(value, limit)`: a short quotable form of any value.
- `safe_filename(name)`: a filename with control characters, separators and unencodable
  characters replaced, at most `MAX_FILENAME_CHARS` characters.
"""

from __future__ import annotations

import re

ECHO_CHARS = 64
MAX_FILENAME_CHARS = 255
# C0/C1 controls, DEL, and lone surrogates (what a non-UTF-8 name decodes to), which JSON
# encoders refuse.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def excerpt(value: object, limit: int = ECHO_CHARS) -> str:
    """`value` as text, control characters escaped, cut to `limit` characters with the length
    it had ("...(3000000 chars)")."""
    text = value if isinstance(value, str) else str(value)
    short = text[:limit]
    short = _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256
                        else "\ufffd", short)
    if len(text) > limit:
        short += f"...({len(text)} chars)"
    return short


def safe_filename(name: str | None, default: str = "upload.jsonl") -> str:
    """A filename fit to store and echo: unsafe characters and path separators become `_`,
    surrounding whitespace goes, at most MAX_FILENAME_CHARS characters; `default` when
    nothing is left."""
    if not name:
        return default
    cleaned = _UNSAFE.sub("_", name[:MAX_FILENAME_CHARS]).replace("/", "_").replace("\\", "_")
    return cleaned.strip() or default
