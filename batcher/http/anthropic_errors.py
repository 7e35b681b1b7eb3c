"""Errors in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, for the
Messages routes (`/v1/messages...`) on replica and router alike: every layer builds errors in
OpenAI's shape, and `reshape_error` turns one into Anthropic's on those paths."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

PREFIX = "/v1/messages"
# HTTP status -> Anthropic error type.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 409: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               504: "api_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500
                           else "api_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def reshape_error(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """On the Messages paths, an error answer in OpenAI's shape in Anthropic's, with the same
    status and headers (Retry-After, X-Request-Id); anything else as it is."""
    if resp.status < 400 or not request.path.startswith(PREFIX) or not isinstance(
            resp, web.Response) or resp.prepared:
        return resp
    try:
        err = orjson.loads(resp.body)["error"]  # type: ignore[arg-type]
        message = str(err["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return resp
    resp.body = orjson.dumps(error_body(resp.status, message))
    return resp
