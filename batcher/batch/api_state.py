"""What the batch API's routes share on an app: the limits, the store, the executor and the line
validation (`BatchService` under `BATCH`), and a request's service and tenant."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from batcher.batch.executor import BatchExecutor
from batcher.batch.jsonl import MAX_LINE_BYTES, MAX_LINES
from batcher.batch.store import BatchStore
from batcher.batch.validate import LineCheck
from batcher.http.errors import ApiError


@dataclass(slots=True)
class BatchLimits:
    """`max_tenant_bytes` / `max_tenant_files`: what one tenant may store (batch outputs
    included); `file_expiry_s`: a file's lifetime unless its upload asks otherwise (None:
    kept until deleted)."""

    max_file_bytes: int = 100 * 2**20
    max_lines: int = MAX_LINES
    max_line_bytes: int = MAX_LINE_BYTES
    max_tenant_bytes: int = 2 * 2**30
    max_tenant_files: int = 1000
    file_expiry_s: float | None = 30 * 86400.0

    def validate(self) -> BatchLimits:
        for name in ("max_file_bytes", "max_lines", "max_line_bytes", "max_tenant_bytes",
                     "max_tenant_files"):
            if getattr(self, name) < 1:
                raise ValueError(f"batch {name.replace('_', ' ')} must be >= 1")
        if self.file_expiry_s is not None and self.file_expiry_s <= 0:
            raise ValueError("batch file expiry must be > 0 seconds (or none)")
        return self


@dataclass(slots=True)
class BatchService:
    """What the routes share: the store, the executor, the limits and the line validation
    (None: lines are checked only for shape, and run to find the rest)."""

    store: BatchStore
    executor: BatchExecutor
    limits: BatchLimits
    check: LineCheck | None = None


BATCH = web.AppKey("batch_service", BatchService)


def batch_service(request: web.Request) -> BatchService:
    svc = request.app.get(BATCH)
    if svc is None:
        raise ApiError(404, "the batch API is not enabled on this server (start it with "
                       "--data-dir)", code="batch_api_disabled")
    return svc


def tenant_of(request: web.Request) -> str:
    return request["tenant"].name
