"""One access line per request, and the JSON log format for machines.

The line names the request (id, tenant, route, status), its tokens, its phases and how it
finished; never its prompt, its output or any key. `--log-format json` turns every log record
into one JSON object per line, the access line's fields as top-level keys."""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from batcher.telemetry.timings import Timings

ACCESS = logging.getLogger("batcher.access")
LOG_FORMATS = ("text", "json")
# The key a handler sets on its `aiohttp` request once it wrote the request's line itself.
LOGGED = "batcher.access_logged"


def log_access(*, request_id: str, tenant: str, route: str, status: int,
               timings: Timings | None, finish_reason: str | None = None,
               priority: str | None = None, error_code: str | None = None,
               outcome: str | None = None) -> None:
    """One line: who, where, the status and how the request ended (`outcome`: done,
    client_disconnect, shutdown, deadline, error, refused), why it was refused or failed
    (`error_code`), its phases and tokens."""
    if not ACCESS.isEnabledFor(logging.INFO):
        return
    fields: dict[str, Any] = {"request_id": request_id, "tenant": tenant, "route": route,
                              "status": status}
    if outcome is not None:
        fields["outcome"] = outcome
    if priority is not None:
        fields["priority"] = priority
    if finish_reason is not None:
        fields["finish_reason"] = finish_reason
    if error_code is not None:
        fields["error_code"] = error_code
    if timings is not None:
        fields.update(timings.to_json())
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    ACCESS.info("%s", text, extra={"access": fields})


def outcome_of(status: int) -> str:
    """How a request ended, told from its status alone (a router, which relays the answer): a
    499 is the client gone, a 504 a deadline, 429/503 and other 4xx refusals, 5xx failures."""
    if status < 400:
        return "done"
    if status == 499:
        return "client_disconnect"
    if status == 504:
        return "deadline"
    return "refused" if status < 500 or status == 503 else "error"


def log_refusal(*, request_id: str, tenant: str, route: str, status: int,
                error_code: str | None) -> None:
    """The line of a request answered with an error before any handler ran it (a key refused,
    an unknown route or model, a body too large): why, where an operator looks."""
    log_access(request_id=request_id, tenant=tenant, route=route, status=status, timings=None,
               error_code=error_code, outcome="error" if status == 500 else "refused")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and an access line's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name,
        }
        fields = getattr(record, "access", None)
        if isinstance(fields, dict):
            out["msg"] = "access"
            out.update(fields)
        else:
            out["msg"] = record.getMessage()
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def configure(level: str, fmt: str = "text") -> None:
    """The process's logging: `fmt` is `text` (human) or `json` (one object per line)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
