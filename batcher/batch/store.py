"""Files, batches and per-line results in SQLite, file bytes in a directory beside it.

Every row carries its tenant and every lookup filters by it: a tenant never sees another's files
or batches (an ID of another tenant is simply not found).

Durability contract (what a restart relies on):
- A line is `pending` until its result is recorded; `record_result` flips it to `done` and bumps the
  batch's counts in one transaction, only if it was still pending. So a line is answered exactly
  once, and a line that was running when the process died is still `pending` and runs again.
- Output and error files are written to a temporary name, fsynced and renamed before the batch
  row names them; their IDs derive from the batch ID, so a finalize cut short by a crash simply
  runs again and overwrites the same files.
- WAL journal with `synchronous=NORMAL`: a committed transaction survives the process being
  killed (the WAL is in the OS's page cache); an OS crash may lose the last few, which then run
  again.

All calls are made from the event loop's thread; each is one short statement or transaction.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from batcher.batch.jsonl import InputLine
from batcher.batch.line_rows import STAGE_ROWS, line_rows
from batcher.batch.records import ACTIVE, TERMINAL, BatchRecord, FileRecord, PendingLine, new_id
from batcher.batch.store_db import Tx, open_db

_FILE_COLS = "id, tenant, filename, purpose, bytes, created_at, expires_at"


@dataclass(frozen=True, slots=True)
class CreatedBounds:
    """Creation-time bounds of a list (Unix seconds): `before` excludes, `since` includes.
    A router merging several replicas' lists continues a page with them."""

    before: int | None = None
    since: int | None = None

    def where(self, sql: str, args: list[Any]) -> tuple[str, list[Any]]:
        if self.before is not None:
            sql += " AND created_at < ?"
            args.append(self.before)
        if self.since is not None:
            sql += " AND created_at >= ?"
            args.append(self.since)
        return sql, args


_BATCH_COLS = ("id, tenant, endpoint, input_file_id, completion_window, status, created_at, "
               "expires_at, in_progress_at, finalizing_at, completed_at, failed_at, expired_at, "
               "cancelling_at, cancelled_at, output_file_id, error_file_id, total, completed, "
               "failed, tokens, metadata, errors")


def _batch(row: tuple[Any, ...]) -> BatchRecord:
    *head, metadata, errors = row
    return BatchRecord(*head, metadata=orjson.loads(metadata) if metadata else None,
                       errors=orjson.loads(errors) if errors else None)


def lock_data_dir(root: Path) -> BinaryIO | None:
    """Take the data directory's lock (held while the returned file stays open), or None when
    another server holds it."""
    f = open(root / ".lock", "a+b")  # noqa: SIM115 (held while open)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


class BatchStore:
    """The batch tier's state: `root/batches.sqlite3` (or `db_path`) and `root/files/`."""

    def __init__(self, root: str | Path, db_path: str | Path | None = None,
                 clock: Callable[[], float] = time.time, lock: BinaryIO | None = None):
        """`lock`: the directory's lock (`lock_data_dir`) when the caller already holds it."""
        self.root = Path(root)
        self.files_dir = self.root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        # One server per data directory: two executors would run the same lines twice.
        held = lock if lock is not None else lock_data_dir(self.root)
        if held is None:
            raise RuntimeError(f"the data directory {self.root} is in use by another "
                               "server")
        self._lock = held
        self.db_path = Path(db_path) if db_path else self.root / "batches.sqlite3"
        self.clock = clock
        self.db = open_db(self.db_path)
        self._clean_uploads()
        # Lines staged for a batch whose creation a crash cut short (no batch row names them),
        # or of a finished batch whose rows a crash left half deleted.
        marks = ", ".join("?" * len(ACTIVE))
        self.db.execute("DELETE FROM lines WHERE batch_id NOT IN (SELECT id FROM batches WHERE "
                        f"status IN ({marks}))", ACTIVE)

    def close(self) -> None:
        self.db.close()
        self._lock.close()  # releases the lock

    def _clean_uploads(self) -> None:
        # Uploads and output files cut short by a crash: never named by a row.
        for p in self.files_dir.glob(".tmp-*"):
            p.unlink(missing_ok=True)

    def _tx(self) -> Tx:
        return Tx(self.db)

    # files ---------------------------------------------------------------------------------
    def temp_path(self) -> Path:
        """Where an upload is written before `add_file` adopts it."""
        return self.files_dir / f".tmp-{secrets.token_hex(8)}"

    def path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, tenant: str, filename: str, purpose: str, temp: Path, size: int,
                 file_id: str | None = None, expires_after_s: float | None = None
                 ) -> FileRecord:
        """Adopt the complete file at `temp` (renamed into place) as a new file of `tenant`,
        deleted `expires_after_s` seconds from now (never when None)."""
        now = int(self.clock())
        expires = None if expires_after_s is None else now + int(expires_after_s)
        rec = FileRecord(file_id or new_id("file-"), tenant, filename, purpose, size, now,
                         expires)
        os.replace(temp, self.path(rec.id))
        self.db.execute(
            "INSERT OR REPLACE INTO files (id, tenant, filename, purpose, bytes, created_at, "
            "expires_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (rec.id, tenant, filename, purpose, size, rec.created_at, expires))
        return rec

    def get_file(self, tenant: str, file_id: str) -> FileRecord | None:
        """The tenant's file; None once it expired (even before housekeeping deleted it)."""
        row = self.db.execute(
            f"SELECT {_FILE_COLS} FROM files WHERE id = ? AND tenant = ? "
            "AND (expires_at IS NULL OR expires_at > ?)",
            (file_id, tenant, self.clock())).fetchone()
        return None if row is None else FileRecord(*row)

    def usage(self, tenant: str) -> tuple[int, int]:
        """(files, bytes) the tenant stores, batch outputs included."""
        count, size = self.db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM files "
                                      "WHERE tenant = ?", (tenant,)).fetchone()
        return count, size

    def delete_expired_files(self, limit: int = 100) -> int:
        """Delete up to `limit` files past their expiry (rows, then bytes); how many."""
        rows = self.db.execute("SELECT id FROM files WHERE expires_at IS NOT NULL AND "
                               "expires_at <= ? LIMIT ?", (self.clock(), limit)).fetchall()
        for (file_id,) in rows:
            self.db.execute("DELETE FROM files WHERE id = ?", (file_id,))
            self.path(file_id).unlink(missing_ok=True)
        return len(rows)

    def list_files(self, tenant: str, limit: int, after: str | None = None,
                   purpose: str | None = None, ascending: bool = False,
                   created: CreatedBounds | None = None) -> tuple[list[FileRecord], bool]:
        """A page of the tenant's files (newest first unless `ascending`) and whether more
        follow. `after` must be a file ID of this tenant (check with `get_file`)."""
        op, order = (">", "ASC") if ascending else ("<", "DESC")
        sql = (f"SELECT {_FILE_COLS} FROM files WHERE tenant = ? "
               "AND (expires_at IS NULL OR expires_at > ?)")
        args: list[Any] = [tenant, self.clock()]
        if purpose is not None:
            sql += " AND purpose = ?"
            args.append(purpose)
        if created is not None:
            sql, args = created.where(sql, args)
        if after is not None:
            sql += f" AND seq {op} (SELECT seq FROM files WHERE id = ?)"
            args.append(after)
        sql += f" ORDER BY seq {order} LIMIT ?"
        args.append(limit + 1)
        rows = self.db.execute(sql, args).fetchall()
        return [FileRecord(*r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, tenant: str, file_id: str) -> bool:
        cur = self.db.execute("DELETE FROM files WHERE id = ? AND tenant = ?", (file_id, tenant))
        if cur.rowcount == 0:
            return False
        self.path(file_id).unlink(missing_ok=True)
        return True

    # batches -------------------------------------------------------------------------------
    def create_batch(self, tenant: str, endpoint: str, input_file_id: str, window: str,
                     window_s: float, metadata: dict[str, str] | None,
                     lines: list[InputLine]) -> BatchRecord:
        """A new batch, `in_progress`, with its lines pending (or answered, see `line_rows`),
        in one call: for a batch small enough to stage at once."""
        bid = new_id("batch_")
        rows = line_rows(bid, lines)
        for i in range(0, len(rows), STAGE_ROWS):
            self.stage_lines(rows[i:i + STAGE_ROWS])
        return self.open_batch(bid, tenant, endpoint, input_file_id, window, window_s, metadata,
                               len(lines), sum(ln.answer is not None for ln in lines))

    def stage_lines(self, rows: list[tuple[Any, ...]]) -> None:
        """Insert lines (`line_rows`) of a batch not opened yet, in one short transaction. Until
        `open_batch` they belong to no batch: a crash leaves them to be removed at the next
        open, and `drop_lines` removes them when the batch is not created after all."""
        with self._tx():
            self.db.executemany(
                "INSERT INTO lines (batch_id, idx, custom_id, body, state, status_code, output, "
                "prompt_tokens, max_tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def open_batch(self, batch_id: str, tenant: str, endpoint: str, input_file_id: str,
                   window: str, window_s: float, metadata: dict[str, str] | None, total: int,
                   failed: int) -> BatchRecord:
        """The batch row over its staged lines, `in_progress`; `failed` of them were answered
        at creation."""
        now = self.clock()
        self.db.execute(
            "INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, "
            "status, created_at, expires_at, in_progress_at, total, failed, metadata) "
            "VALUES (?, ?, ?, ?, ?, 'in_progress', ?, ?, ?, ?, ?, ?)",
            (batch_id, tenant, endpoint, input_file_id, window, now, now + window_s, now,
             total, failed, orjson.dumps(metadata).decode() if metadata else None))
        rec = self.get_batch(tenant, batch_id)
        assert rec is not None
        return rec

    def create_failed_batch(self, tenant: str, endpoint: str, input_file_id: str, window: str,
                            window_s: float, metadata: dict[str, str] | None,
                            errors: list[dict[str, Any]]) -> BatchRecord:
        """A batch whose input failed validation: kept (and listed) with its errors, as
        OpenAI does, rather than refused."""
        now = self.clock()
        bid = new_id("batch_")
        self.db.execute(
            "INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, "
            "status, created_at, expires_at, failed_at, metadata, errors) "
            "VALUES (?, ?, ?, ?, ?, 'failed', ?, ?, ?, ?, ?)",
            (bid, tenant, endpoint, input_file_id, window, now, now + window_s, now,
             orjson.dumps(metadata).decode() if metadata else None,
             orjson.dumps(errors).decode()))
        rec = self.get_batch(tenant, bid)
        assert rec is not None
        return rec

    def get_batch(self, tenant: str, batch_id: str) -> BatchRecord | None:
        row = self.db.execute(f"SELECT {_BATCH_COLS} FROM batches WHERE id = ? AND tenant = ?",
                              (batch_id, tenant)).fetchone()
        return None if row is None else _batch(row)

    def batch(self, batch_id: str) -> BatchRecord | None:
        """Any tenant's batch: for the executor only."""
        row = self.db.execute(f"SELECT {_BATCH_COLS} FROM batches WHERE id = ?",
                              (batch_id,)).fetchone()
        return None if row is None else _batch(row)

    def list_batches(self, tenant: str, limit: int, after: str | None = None,
                     created: CreatedBounds | None = None) -> tuple[list[BatchRecord], bool]:
        sql = f"SELECT {_BATCH_COLS} FROM batches WHERE tenant = ?"
        args: list[Any] = [tenant]
        if created is not None:
            sql, args = created.where(sql, args)
        if after is not None:
            sql += " AND seq < (SELECT seq FROM batches WHERE id = ?)"
            args.append(after)
        rows = self.db.execute(sql + " ORDER BY seq DESC LIMIT ?", (*args, limit + 1)).fetchall()
        return [_batch(r) for r in rows[:limit]], len(rows) > limit

    def active_batches(self) -> list[BatchRecord]:
        """Every tenant's unfinished batches, oldest first: the executor's work list."""
        marks = ", ".join("?" * len(ACTIVE))
        rows = self.db.execute(f"SELECT {_BATCH_COLS} FROM batches WHERE status IN ({marks}) "
                               "ORDER BY seq", ACTIVE).fetchall()
        return [_batch(r) for r in rows]

    def set_status(self, batch_id: str, status: str, only_from: tuple[str, ...] = ACTIVE
                   ) -> bool:
        """Move a batch to `status` (stamping `<status>_at`) if it is in one of `only_from`."""
        assert status in ("finalizing", "cancelling", "completed", "expired", "cancelled",
                          "failed")
        marks = ", ".join("?" * len(only_from))
        cur = self.db.execute(
            f"UPDATE batches SET status = ?, {status}_at = ? WHERE id = ? AND status IN ({marks})",
            (status, self.clock(), batch_id, *only_from))
        return cur.rowcount == 1

    # lines ---------------------------------------------------------------------------------
    def pending_lines(self, batch_id: str) -> list[tuple[int, int, int]]:
        """(index, prompt tokens, max output tokens) of every pending line, in order."""
        return self.db.execute("SELECT idx, prompt_tokens, max_tokens FROM lines WHERE "
                               "batch_id = ? AND state = 'pending' ORDER BY idx",
                               (batch_id,)).fetchall()

    def line_bytes(self, batch_id: str, index: int) -> tuple[str, bytes] | None:
        """(custom_id, body as JSON text) of a line: parsed by the caller, off the event loop
        when large."""
        return self.db.execute("SELECT custom_id, body FROM lines WHERE batch_id = ? AND "
                               "idx = ?", (batch_id, index)).fetchone()

    def pending_indices(self, batch_id: str) -> list[int]:
        rows = self.db.execute("SELECT idx FROM lines WHERE batch_id = ? AND state = 'pending' "
                               "ORDER BY idx", (batch_id,)).fetchall()
        return [r[0] for r in rows]

    def line(self, batch_id: str, index: int) -> PendingLine | None:
        row = self.db.execute("SELECT custom_id, body FROM lines WHERE batch_id = ? AND idx = ?",
                              (batch_id, index)).fetchone()
        return None if row is None else PendingLine(batch_id, index, row[0],
                                                     orjson.loads(row[1]))

    def record_result(self, batch_id: str, index: int, status_code: int, output: bytes,
                      tokens: int) -> bool:
        """Record a line's answer (its output-file line). False, changing nothing, when the line
        was already answered: each line is answered exactly once."""
        ok = 200 <= status_code < 300
        with self._tx():
            cur = self.db.execute(
                "UPDATE lines SET state = 'done', status_code = ?, output = ? "
                "WHERE batch_id = ? AND idx = ? AND state = 'pending'",
                (status_code, output, batch_id, index))
            if cur.rowcount != 1:
                return False
            self.db.execute(
                "UPDATE batches SET completed = completed + ?, failed = failed + ?, "
                "tokens = tokens + ? WHERE id = ?", (int(ok), int(not ok), tokens, batch_id))
        return True

    def outputs(self, batch_id: str) -> Iterator[tuple[str, int | None, bytes | None]]:
        """(custom_id, status_code, output line) of every line in input order; status and
        output are None for lines never answered."""
        cur = self.db.execute("SELECT custom_id, status_code, output FROM lines "
                              "WHERE batch_id = ? ORDER BY idx", (batch_id,))
        yield from cur

    def finish(self, batch_id: str, status: str, output_file: FileRecord | None,
               error_file: FileRecord | None, failed: int | None = None) -> bool:
        """End a batch: name its output files and stamp its final status. `failed` overrides
        the failed count (unanswered lines of a cancelled or expired batch count as failed)."""
        assert status in TERMINAL
        now = self.clock()
        with self._tx():
            cur = self.db.execute(
                f"UPDATE batches SET status = ?, {status}_at = ?, output_file_id = ?, "
                "error_file_id = ?, failed = COALESCE(?, failed) WHERE id = ? AND status IN "
                f"({', '.join('?' * len(ACTIVE))})",
                (status, now, output_file and output_file.id, error_file and error_file.id,
                 failed, batch_id, *ACTIVE))
            if cur.rowcount != 1:
                return False
            if status == "completed":
                self.db.execute("UPDATE batches SET finalizing_at = COALESCE(finalizing_at, ?) "
                                "WHERE id = ?", (now, batch_id))
        return True

    def drop_lines(self, batch_id: str, limit: int | None = None) -> int:
        """Delete the per-line rows of a finished batch (its output files now hold the answers)
        or of one never created; at most `limit` of them. How many were deleted."""
        if limit is None:
            return self.db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,)).rowcount
        return self.db.execute(
            "DELETE FROM lines WHERE batch_id = ? AND idx IN (SELECT idx FROM lines WHERE "
            "batch_id = ? LIMIT ?)", (batch_id, batch_id, limit)).rowcount
