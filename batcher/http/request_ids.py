"""Request IDs: the one pattern a client-sent `X-Request-Id` must match, and fresh IDs.

A client may send its own ID (retries, dedupe); one that does not match is a 400 on the replica and
is replaced by a fresh one on the router, which must never forward a header it would not accept.
"""

from __future__ import annotations

import re

from batcher.http.errors import invalid
from batcher.core.request_registry import new_request_id

__all__ = ["HEADER", "REQUEST_ID_PATTERN", "client_request_id", "is_valid_request_id",
           "new_request_id", "request_id_or_new"]

REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
HEADER = "X-Request-Id"


def is_valid_request_id(value: str) -> bool:
    return REQUEST_ID_PATTERN.fullmatch(value) is not None


def client_request_id(value: str | None) -> str | None:
    """A client-sent X-Request-Id, or None when absent; `ApiError` (400) when malformed."""
    if value is None:
        return None
    if not is_valid_request_id(value):
        raise invalid("X-Request-Id must be 1-128 characters of [A-Za-z0-9._:-]", HEADER)
    return value


def request_id_or_new(value: str | None) -> str:
    """The client's X-Request-Id when well formed, else a fresh one (never raises)."""
    if value is not None and is_valid_request_id(value):
        return value
    return new_request_id()
