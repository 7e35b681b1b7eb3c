"""The batch store's SQLite database: its schema (columns added since the first schema are added
at open), the connection's settings (WAL, `synchronous=NORMAL`, autocommit) and explicit
transactions."""

from __future__ import annotations

import sqlite3
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    in_progress_at REAL, finalizing_at REAL, completed_at REAL, failed_at REAL,
    expired_at REAL, cancelling_at REAL, cancelled_at REAL,
    output_file_id TEXT, error_file_id TEXT,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    tokens INTEGER NOT NULL DEFAULT 0,
    metadata TEXT,
    errors TEXT
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    body BLOB NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    status_code INTEGER,
    output BLOB,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    max_tokens INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, idx)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS lines_by_state ON lines (batch_id, state, idx);
"""
# Columns added since the first schema: a database made before them gains them at open.
_ADDED = (("files", "expires_at", "INTEGER"),
          ("lines", "prompt_tokens", "INTEGER NOT NULL DEFAULT 0"),
          ("lines", "max_tokens", "INTEGER NOT NULL DEFAULT 0"))


def open_db(path: Path) -> sqlite3.Connection:
    """The store's database at `path`, its schema made or brought up to date."""
    # isolation_level=None: statements autocommit; transactions are explicit (`Tx`).
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA busy_timeout=5000")
    db.executescript(_SCHEMA)
    for table, column, decl in _ADDED:
        have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
        if column not in have:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
    db.execute("CREATE INDEX IF NOT EXISTS files_by_expiry ON files (expires_at) "
               "WHERE expires_at IS NOT NULL")
    return db


class Tx:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on an exception."""

    __slots__ = ("db",)

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.db.execute("ROLLBACK" if exc_type is not None else "COMMIT")
