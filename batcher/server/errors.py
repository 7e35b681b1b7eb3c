"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable", 504: "timeout_error"}


class ApiError(Exception):
    """A client-facing error with its HTTP status; `retry_after` adds a Retry-After header."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, retry_after: float | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}

    def response(self, request_id: str | None = None) -> web.Response:
        headers = dict(self.headers)
        if self.retry_after is not None:
            # Whole seconds, rounded up: a client honouring it must not come back too early.
            headers["Retry-After"] = str(max(1, int(-(-self.retry_after // 1))))
        if request_id:
            headers["X-Request-Id"] = request_id
        resp = web.Response(status=self.status, body=orjson.dumps(self.body()),
                            content_type="application/json", headers=headers)
        if headers.get("Connection", "").lower() == "close":
            resp.force_close()  # the header alone would not end the server's keep-alive
        return resp


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)
