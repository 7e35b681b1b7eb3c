"""Why the engine refuses a request before running it, as types (never matched by message).

All are `ValueError`s: each is the client's to fix, and the HTTP layer answers it with a 4xx
naming `param`, never a 5xx.
"""

from __future__ import annotations


class Refused(ValueError):
    """The request can never run as sent. `param` names the field to change, when one does."""

    param: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        if param is not None:
            self.param = param


class DuplicateRequestId(Refused):
    """A request ID that is already in flight was registered again (HTTP 409)."""

    param = "X-Request-Id"


class EmptyPrompt(Refused):
    """The prompt has no tokens."""

    param = "prompt"


class ExceedsContext(Refused):
    """Prompt plus max_tokens is longer than the model's context."""

    param = "max_tokens"


class ExceedsKvCapacity(Refused):
    """The request needs more KV blocks than the whole pool holds: it does not fit, ever."""

    param = "max_tokens"
