"""`x-should-retry`: OpenAI's SDKs retry 408, 409, 429 and every 5xx twice unless told; we tell
them not to where a retry cannot help, and to where capacity comes back."""

from __future__ import annotations

import pytest

from batcher.http.errors import ApiError, should_retry


@pytest.mark.parametrize(("status", "code", "header"), [
    (400, "invalid_value", "false"),
    (401, "invalid_api_key", "false"),
    (404, None, "false"),
    (413, "body_too_large", "false"),
    (408, None, None),
    (409, None, None),
    (429, "rate_limited", "true"),
    (503, "overloaded", "true"),
    (504, "deadline_exceeded", "false"),
    (504, "upstream_timeout", None),
    (500, None, None),
    (502, None, None),
])
def test_header_by_status(status: int, code: str | None, header: str | None) -> None:
    assert should_retry(status, code) == header
    resp = ApiError(status, "m", code=code).response("req-1")
    assert resp.headers.get("x-should-retry") == header


def test_an_explicit_header_wins() -> None:
    resp = ApiError(503, "m", headers={"X-Should-Retry": "false"}).response()
    assert resp.headers["x-should-retry"] == "false"
