"""The `limit` of the OpenAI list endpoints (files, batches), read one way by the replica that
lists its own objects and by the router that merges pages from many."""

from __future__ import annotations

from collections.abc import Mapping

from batcher.http.errors import invalid

MAX_LIST_LIMIT = 100  # objects per page, as OpenAI's API
DEFAULT_LIST_LIMIT = 20


def list_limit(query: Mapping[str, str]) -> int:
    """`limit` from a query string: an integer from 1 to MAX_LIST_LIMIT (default 20), else a
    400 naming the parameter."""
    raw = query.get("limit", str(DEFAULT_LIST_LIMIT))
    # isascii: str.isdigit() also takes digits int() refuses ('²'), which would be a 500; and
    # int() of 5,000 digits raises.
    digits = raw.isascii() and raw.isdigit() and len(raw) <= 6
    if not digits or not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise invalid(f"'limit' must be an integer from 1 to {MAX_LIST_LIMIT}", "limit")
    return int(raw)
