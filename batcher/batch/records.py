"""What the batch API stores, in the shapes it answers with: file and batch records (OpenAI's
`file` and `batch` objects), a line still to run, batch states, and fresh IDs."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
# Batches the executor works on: lines to run, or a finalize still owed.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass(slots=True)
class FileRecord:
    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    expires_at: int | None = None

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes,
                "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": "processed", "status_details": None,
                "expires_at": self.expires_at}


@dataclass(slots=True)
class BatchRecord:
    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: float
    expires_at: float
    in_progress_at: float | None
    finalizing_at: float | None
    completed_at: float | None
    failed_at: float | None
    expired_at: float | None
    cancelling_at: float | None
    cancelled_at: float | None
    output_file_id: str | None
    error_file_id: str | None
    total: int
    completed: int
    failed: int
    tokens: int
    metadata: dict[str, str] | None
    errors: list[dict[str, Any]] | None

    @property
    def finished_lines(self) -> int:
        return self.completed + self.failed

    def to_openai(self) -> dict[str, Any]:
        def ts(x: float | None) -> int | None:
            return None if x is None else int(x)

        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "errors": None if not self.errors else {"object": "list", "data": self.errors},
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id, "created_at": ts(self.created_at),
            "in_progress_at": ts(self.in_progress_at), "expires_at": ts(self.expires_at),
            "finalizing_at": ts(self.finalizing_at), "completed_at": ts(self.completed_at),
            "failed_at": ts(self.failed_at), "expired_at": ts(self.expired_at),
            "cancelling_at": ts(self.cancelling_at), "cancelled_at": ts(self.cancelled_at),
            "request_counts": {"total": self.total, "completed": self.completed,
                               "failed": self.failed},
            "metadata": self.metadata,
        }


@dataclass(slots=True)
class PendingLine:
    batch_id: str
    index: int
    custom_id: str
    body: dict[str, Any]
