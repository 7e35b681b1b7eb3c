"""A tenant that floods the server with malformed requests is refused everything for a while.

Each malformed request (a body that is not JSON, nested past the limit, a field of the wrong
type or value: a 400 with one of `MALFORMED_CODES`) is refused cheaply, but a client sending
them in a loop is answered well over a thousand times a second, and the event loop every other
tenant needs is spent reading, parsing and refusing. So `THRESHOLD` such refusals within `WINDOW_S` start a cool-down of `COOLDOWN_S`:
the tenant's requests with a body are refused before it is read (429 `malformed_cooldown` +
Retry-After, the connection closed, the answer held a second: `batcher.server.cooldown`). The
rate is far past what a client with a bug sends, or a sequential client can: each of its requests
waits for the answer before the next.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from batcher.server.cooldown import TenantCooldown

# The refusals that say a request was malformed (not a prompt too long, an unknown model, ...).
MALFORMED_CODES = frozenset({"invalid_json", "json_too_deep", "invalid_value", "invalid_type",
                             "invalid_body", "invalid_request", "invalid_content_type",
                             "body_incomplete"})
THRESHOLD = 500
WINDOW_S = 1.0
COOLDOWN_S = 10.0


def malformed_cooldown(cooldown_s: float = COOLDOWN_S, threshold: int = THRESHOLD,
                       window_s: float = WINDOW_S,
                       clock: Callable[[], float] = time.monotonic) -> TenantCooldown:
    """`note(tenant)` at each refusal of a request as malformed (`MALFORMED_CODES`);
    `check(tenant)` before reading a body (429 `malformed_cooldown`, connection closed)."""
    return TenantCooldown(cooldown_s, "malformed_cooldown",
                          f"{threshold} requests of yours were refused as malformed within "
                          f"{window_s:g} s; requests with a body are refused for {{seconds}} s "
                          "after that", close=True, clock=clock, threshold=threshold,
                          window_s=window_s)
