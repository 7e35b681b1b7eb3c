"""A batch's end in files: every answer written to its output or error file as it is read from
the store (a batch's output is never held in memory whole), each unanswered line as an error
naming why, the files adopted by the store, the batch marked with its final status and its
lines dropped."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import BinaryIO

from batcher.batch.lines import unanswered_line
from batcher.batch.metrics import BatchMetrics
from batcher.batch.records import FileRecord
from batcher.batch.store import BatchStore

# Lines a finalize writes (or deletes from the store) between yields to the event loop.
FINALIZE_SLICE = 2000
# Output files are written through a buffer this large: few system calls on the event loop.
_WRITE_BUFFER = 1 << 20
UNANSWERED = {"cancelled": ("batch_cancelled", "the batch was cancelled before this request ran"),
              "expired": ("batch_expired",
                          "the batch's completion window ended before this request ran")}


async def write_outputs(store: BatchStore, metrics: BatchMetrics, batch_id: str, tenant: str,
                        status: str, file_expiry_s: float | None) -> None:
    """Write the output and error files and mark the batch `status`. Answers go to the
    files as they are read, so a batch's output is never held in memory whole (50,000
    lines with logprobs can be gigabytes)."""
    sinks = {kind: _LineFile(store.temp_path()) for kind in ("output", "error")}
    unanswered = 0
    try:
        for n, (custom_id, code, output) in enumerate(store.outputs(batch_id), 1):
            if n % FINALIZE_SLICE == 0:
                await asyncio.sleep(0)  # let the loop answer others between slices
            if output is None:
                unanswered += 1
                sinks["error"].add(unanswered_line(custom_id, *UNANSWERED.get(
                    status, ("batch_failed", "the request did not run"))))
            elif 200 <= code < 300:
                sinks["output"].add(output)
            else:
                sinks["error"].add(output)
        out = await _adopt(store, batch_id, tenant, "output", sinks["output"], file_expiry_s)
        err = await _adopt(store, batch_id, tenant, "error", sinks["error"], file_expiry_s)
    finally:
        for sink in sinks.values():
            sink.discard()
    rec = store.batch(batch_id)
    failed = rec.failed + unanswered if rec is not None and unanswered else None
    if store.finish(batch_id, status, out, err, failed):
        metrics.done.labels("unanswered").inc(unanswered)
    while store.drop_lines(batch_id, FINALIZE_SLICE):
        await asyncio.sleep(0)


async def _adopt(store: BatchStore, batch_id: str, tenant: str, kind: str, sink: _LineFile,
                 file_expiry_s: float | None) -> FileRecord | None:
    """The file `sink` wrote as the batch's `kind` file; None when it has no line."""
    if not sink.size:
        return None
    await asyncio.to_thread(sink.close)
    # The ID derives from the batch's: a finalize repeated after a crash replaces the file.
    return store.add_file(tenant, f"{batch_id}_{kind}.jsonl", "batch_output", sink.path,
                          sink.size, file_id=f"file-{batch_id.removeprefix('batch_')}-{kind}",
                          expires_after_s=file_expiry_s)


class _LineFile:
    """An output file written line by line, opened on its first line; `close` makes it durable
    (the store then renames it into place), `discard` removes what was not adopted."""

    __slots__ = ("f", "path", "size")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.f: BinaryIO | None = None
        self.size = 0

    def add(self, line: bytes) -> None:
        if self.f is None:
            # Open across many `add` calls; closed by `close` or `discard`.
            self.f = open(self.path, "wb", buffering=_WRITE_BUFFER)  # noqa: SIM115
        self.f.write(line)
        self.f.write(b"\n")
        self.size += len(line) + 1

    def close(self) -> None:
        assert self.f is not None
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        self.f = None

    def discard(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None
        self.path.unlink(missing_ok=True)  # gone already once adopted (renamed)
