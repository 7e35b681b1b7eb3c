"""A tenant whose very large request was just refused for the context's length has its next
very large bodies refused before they are read.

A prompt longer than the context can hold is refused before tokenizing (`Gateway.
check_text_fits`), but only after its body was read and parsed: megabytes of socket reads and
JSON on the event loop, which every other tenant's requests wait behind. A client that sends such
bodies in a loop kept the loop busy with nothing but refusals. So after one such refusal, the
tenant's bodies over `OVERSIZE_BYTES` are refused from their `Content-Length` alone for
`COOLDOWN_S` (429 `oversize_cooldown` + Retry-After), and the connection is closed rather than
drained. Smaller requests, and other tenants, are served as usual.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from batcher.server.cooldown import TenantCooldown

COOLDOWN_S = 10.0
# Bodies from this size up count as very large: far past any prompt that fits the bundled
# model's context (8,192 tokens of ~4 bytes each is about 32 KiB of text), still under the
# default body limit (4 MiB), so a long-context model's real prompts pass while cooling down
# only if they are smaller than this.
OVERSIZE_BYTES = 1 << 20


def oversize_cooldown(cooldown_s: float = COOLDOWN_S,
                      clock: Callable[[], float] = time.monotonic) -> TenantCooldown:
    """`note(tenant)` when a body over `OVERSIZE_BYTES` is refused for its length; `check(tenant)`
    before reading a body over it (429 `oversize_cooldown`, connection closed)."""
    return TenantCooldown(cooldown_s, "oversize_cooldown",
                          "a request of yours over 1 MiB was just refused as longer than the "
                          "model's context; bodies over 1 MiB are refused for {seconds} s after "
                          "that", close=True, clock=clock)
