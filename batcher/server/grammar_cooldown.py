"""A tenant whose constrained request was just cut for its grammar's cost waits a while before
its next constrained request is taken.

The grammar budget (`runtime/grammar.py`) bounds what one request adds to other requests' steps,
but a client resubmitting the same ambiguous grammar in a loop pays that cost again every time,
and every step of every tenant carries it. So after a cut, the tenant's requests with a grammar
are refused (429 `grammar_cooldown` + Retry-After) for `COOLDOWN_S`; its requests without one
are served as usual (`batcher.server.cooldown`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from batcher.server.cooldown import TenantCooldown

# Long enough that a client looping on an ambiguous grammar spends most of its time refused (a
# cut comes a few tokens, tens of milliseconds, into a request), short enough that a tenant cut
# once by a loaded machine is back soon.
COOLDOWN_S = 10.0


# Request fields that ask for a grammar (`batcher.structured.grammars`), looked at before the
# body is parsed: a tenant cooling down is refused before its grammar is compiled.
GRAMMAR_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def asks_for_grammar(body: object) -> bool:
    """Whether a request body names a grammar (a cheap look before parsing it; tool calls that
    end up constrained are caught after parsing)."""
    if not isinstance(body, dict):
        return False
    if any(body.get(k) is not None for k in GRAMMAR_FIELDS):
        return True
    fmt = body.get("response_format")
    return isinstance(fmt, dict) and fmt.get("type") not in (None, "text")


def grammar_cooldown(cooldown_s: float = COOLDOWN_S,
                     clock: Callable[[], float] = time.monotonic) -> TenantCooldown:
    """The cool-down after a grammar cut: `note(tenant)` at the cut, `check(tenant)` before a
    constrained request (429 `grammar_cooldown`)."""
    return TenantCooldown(cooldown_s, "grammar_cooldown",
                          "a request of yours was cut for its grammar's cost; requests with a "
                          "grammar are refused for {seconds} s after that (use a less "
                          "ambiguous grammar)", param="response_format", clock=clock)
