"""A tenant whose constrained request was just cut for its grammar's cost waits a while before
its next constrained request is taken.

The grammar budget (`runtime/grammar.py`) bounds what one request adds to other requests' steps,
but a client resubmitting the same ambiguous grammar in a loop pays that cost again every time,
and every step of every tenant carries it. So after a cut, the tenant's requests with a grammar
are refused (429 `grammar_cooldown` + Retry-After) for `COOLDOWN_S`; its requests without one
are served as usual. One bounded map on the event loop, no locks.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

from batcher.http.errors import ApiError

# Long enough that a client looping on an ambiguous grammar spends most of its time refused (a
# cut comes a few tokens, tens of milliseconds, into a request), short enough that a tenant cut
# once by a loaded machine is back soon.
COOLDOWN_S = 10.0
# Tenants remembered at most (oldest forgotten first): tenants are configured, so this is a bound
# against a bug, not a limit anyone reaches.
MAX_TENANTS = 10_000


# Request fields that ask for a grammar (`batcher.structured.grammars`), looked at before the body is
# parsed: a tenant cooling down is refused before its grammar is compiled.
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


class GrammarCooldown:
    def __init__(self, cooldown_s: float = COOLDOWN_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cooldown_s, self.clock = cooldown_s, clock
        self._cut_at: OrderedDict[str, float] = OrderedDict()

    def note_cut(self, tenant: str) -> None:
        """One of `tenant`'s requests was cut for its grammar's cost just now."""
        self._cut_at[tenant] = self.clock()
        self._cut_at.move_to_end(tenant)
        while len(self._cut_at) > MAX_TENANTS:
            self._cut_at.popitem(last=False)

    def check(self, tenant: str) -> None:
        """Raise 429 `grammar_cooldown` while `tenant` is cooling down after a cut."""
        at = self._cut_at.get(tenant)
        if at is None:
            return
        left = at + self.cooldown_s - self.clock()
        if left <= 0:
            del self._cut_at[tenant]
            return
        raise ApiError(429, f"a request of yours was cut for its grammar's cost; requests with "
                       f"a grammar are refused for {self.cooldown_s:g} s after that (use a less "
                       "ambiguous grammar)", param="response_format", code="grammar_cooldown",
                       retry_after=max(1, math.ceil(left)))
