"""Refusals held back a moment before they are sent, a bounded number at once.

A caller refused for a cool-down (429 + Retry-After) that sends again at once, in a loop, gets
its refusals as fast as the server can write them: thousands a second, each a request parsed and
an answer written on the event loop every other caller waits behind, and on one machine the
caller's own loop takes CPU from everyone too. Holding each such refusal for a second before it is
sent slows a looping client to one request a second per connection, at the cost of a sleeping
coroutine and an open socket; the count held at once is bounded (past it, refusals go out at
once), so holding can never itself exhaust the server.
"""

from __future__ import annotations

import asyncio

# Refusals held at once, across every caller: past this they are sent at once.
MAX_HELD = 64


class HeldAnswers:
    """`await held.hold(seconds)` before sending a refusal that asks to be held."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int = MAX_HELD) -> None:
        self.limit = limit
        self.held = 0

    async def hold(self, seconds: float) -> bool:
        """Wait `seconds` unless `limit` refusals are already waiting; whether it waited."""
        if seconds <= 0 or self.held >= self.limit:
            return False
        self.held += 1
        try:
            await asyncio.sleep(seconds)
        finally:
            self.held -= 1
        return True
