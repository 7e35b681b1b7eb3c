"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

One builder for replica and router alike, so a status always carries the same `type`.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
    413: "invalid_request_error", 429: "rate_limit_error", 502: "service_unavailable",
    503: "service_unavailable", 504: "timeout_error",
}


def error_type(status: int) -> str:
    """The OpenAI `type` for an HTTP status; `api_error` for any status without its own."""
    return ERROR_TYPES.get(status, "api_error")


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The JSON body of an error (also the payload of an SSE error event)."""
    return {"error": {"message": bounded_message(message), "type": error_type(status),
                      "param": param,
                      "code": code}}


# Statuses a client may retry as they are: a timeout of the connection, a conflict that passes,
# a rate limit. Every other 4xx is the request itself; sending it again cannot succeed.
_RETRYABLE_4XX = frozenset({408, 409, 429})
# 504s that are the request's own deadline (its `timeout`): a retry would time out again.
_DEADLINE_CODES = frozenset({"deadline_exceeded", "timeout"})


def should_retry(status: int, code: str | None) -> str | None:
    """The `x-should-retry` header OpenAI's SDKs obey: "false" where a retry cannot help (a 4xx
    other than 408/409/429, a 504 for the request's own deadline), "true" for a 503 or 429
    (capacity that comes back), None to leave the client's default."""
    if status in (429, 503):
        return "true"
    if 400 <= status < 500 and status not in _RETRYABLE_4XX:
        return "false"
    if status == 504 and code in _DEADLINE_CODES:
        return "false"
    return None


def retry_after_header(seconds: float) -> str:
    """Whole seconds, rounded up and at least 1: a client honouring it must not come back early."""
    return str(max(1, int(-(-seconds // 1))))


# An error message quotes what the client sent (an id, a model name, a field) to say what was
# wrong; past this it says how long it was instead. A 3 MB id must not come back as a 3 MB 404.
MAX_MESSAGE_CHARS = 1024


def bounded_message(message: str) -> str:
    """`message` cut to MAX_MESSAGE_CHARS characters, saying how long it was."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}...(message cut; {len(message)} characters)"


class ApiError(Exception):
    """A client-facing error with its HTTP status. Raise it from a handler; a middleware turns it
    into `response()`. `retry_after` adds a Retry-After header; `headers` are sent as given.
    `hold_s`: the answer is held this long before it is sent (`batcher.http.held_answers`), for
    a caller refused for a cool-down it did not wait out."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, retry_after: float | None = None,
                 headers: dict[str, str] | None = None, hold_s: float = 0.0):
        message = bounded_message(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.headers = dict(headers or {})
        self.hold_s = hold_s

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self, request_id: str | None = None) -> web.Response:
        headers = dict(self.headers)
        retry = should_retry(self.status, self.code)
        if retry is not None and not any(k.lower() == "x-should-retry" for k in headers):
            headers["x-should-retry"] = retry
        if self.retry_after is not None:
            headers["Retry-After"] = retry_after_header(self.retry_after)
        # A refusal for now names its reason in a header too, so a client, a benchmark and a
        # router read why without parsing the body: the same word as the body's code.
        if self.status in (429, 503) and self.code and not any(
                k.lower() == "x-reject-reason" for k in headers):
            headers["X-Reject-Reason"] = self.code
        if request_id:
            headers["X-Request-Id"] = request_id
        resp = web.Response(status=self.status, body=orjson.dumps(self.body()),
                            content_type="application/json", headers=headers)
        if headers.get("Connection", "").lower() == "close":
            resp.force_close()  # the header alone would not end the server's keep-alive
        return resp


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    """A 400 naming the offending field."""
    return ApiError(400, message, param=param, code=code)


def bool_field(body: dict[str, Any], key: str, default: bool) -> bool:
    """`body[key]` as a boolean: absent or null is `default`; anything but true or false is a
    400 naming the field."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"'{key}' must be a boolean", key, "invalid_type")
    return v


def from_http_exception(exc: web.HTTPException) -> ApiError:
    """aiohttp's own 4xx/5xx (no route, wrong method, body too large) in OpenAI's shape; keeps
    `Allow` on a 405, which clients (and RFC 9110) rely on."""
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return ApiError(413, "the request body is too large", code="body_too_large")
    extra = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    reason = exc.reason or "error"
    return ApiError(exc.status, reason, code=reason.lower().replace(" ", "_"), headers=extra)
