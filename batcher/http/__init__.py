"""The HTTP toolkit shared by replica (`batcher.server`) and router (`batcher.fleet`): a fix made
once is made everywhere. Of `batcher` it imports only the request-ID registry (whose IDs
it hands out).

- `errors`: `ApiError`, `invalid`, `error_body`, `error_type`, `from_http_exception`: one
  OpenAI-shaped error `{"error": {"message", "type", "param", "code"}}`, one `type` per status.
- `sse`: `sse_event`, `DONE`, `SEP`, `SSE_HEADERS`: server-sent events framing.
- `request_ids`: `new_request_id`, `is_valid_request_id`, `client_request_id` (400 on a bad one),
  `request_id_or_new` (replace a bad one): one pattern for `X-Request-Id`.
- `keys`: `bearer_matches`, `bearer_token`, `single_header`, `same_secret`, `AuthError`:
  constant-time key checks that never raise on odd header bytes.
- `responses`: `json_response` with orjson.
- `middleware`: `api_middleware(...)`, the public API's (request ID, body limit, the caller's
  key, OpenAI-shaped errors with their access lines) on replica and router; `answer_errors`
  (OpenAI-shaped errors, a request ID on every answer) and `require_bearer(key, message)` for
  admin and internal listeners.
- `listener`: what every listener needs around its handlers (see its docstring).
"""

from __future__ import annotations

from batcher.http.errors import ApiError, error_body, error_type, from_http_exception, invalid
from batcher.http.keys import AuthError, bearer_matches, bearer_token, same_secret, single_header
from batcher.http.request_ids import (
    client_request_id,
    is_valid_request_id,
    new_request_id,
    request_id_or_new,
)
from batcher.http.responses import json_response
from batcher.http.sse import DONE, SEP, SSE_HEADERS, sse_event

__all__ = [
    "DONE", "SEP", "SSE_HEADERS", "ApiError", "AuthError", "bearer_matches", "bearer_token",
    "client_request_id", "error_body", "error_type", "from_http_exception", "invalid",
    "is_valid_request_id", "json_response", "new_request_id", "request_id_or_new", "same_secret",
    "single_header", "sse_event",
]
