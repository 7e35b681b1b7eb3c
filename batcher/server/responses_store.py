"""Stored responses (`store: true`): per tenant, for `previous_response_id`, `GET` and `DELETE`.

Each entry is the response object and the conversation a later turn continues from (every
earlier turn's input and output as chat messages, without instructions). Every lookup filters by
tenant: another tenant's id is simply not found.

Where: `DATA_DIR/responses.sqlite3` when the server has a data directory (`--data-dir`), so
responses outlive a restart; otherwise a bounded in-memory store, lost on restart. Retention:
at most `max_count` responses (the oldest go first) and none older than `max_age_s`, on both.
Calls are made from the event loop's thread; each is one short statement.
"""

from __future__ import annotations

import argparse
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import orjson

DAY_S = 86_400.0


@dataclass(slots=True)
class Retention:
    max_count: int = 10_000
    max_age_s: float = 30 * DAY_S  # OpenAI keeps stored responses 30 days

    def validate(self) -> Retention:
        if self.max_count < 1:
            raise ValueError("--responses-max-stored must be >= 1")
        if not self.max_age_s > 0:
            raise ValueError("--responses-max-age must be > 0 seconds")
        return self


@dataclass(slots=True)
class StoreConfig:
    """Where stored responses live (None: in memory) and how long."""

    data_dir: Path | None = None
    retention: Retention = field(default_factory=Retention)


@dataclass(slots=True)
class Stored:
    response: dict[str, Any]
    messages: list[dict[str, Any]]


class ResponseStore(Protocol):
    durable: bool

    def put(self, tenant: str, rid: str, response: dict[str, Any],
            messages: list[dict[str, Any]]) -> None: ...

    def get(self, tenant: str, rid: str) -> Stored | None: ...

    def delete(self, tenant: str, rid: str) -> bool: ...

    def close(self) -> None: ...


class MemoryStore:
    """The store of a server without a data directory: bounded, lost on restart."""

    durable = False

    def __init__(self, retention: Retention, clock: Callable[[], float] = time.time) -> None:
        self.retention = retention
        self.clock = clock
        self._items: OrderedDict[tuple[str, str], tuple[float, bytes, bytes]] = OrderedDict()

    def put(self, tenant: str, rid: str, response: dict[str, Any],
            messages: list[dict[str, Any]]) -> None:
        # Kept as JSON bytes: a caller mutating what it passed or got never changes the store.
        self._items[(tenant, rid)] = (self.clock(), orjson.dumps(response),
                                      orjson.dumps(messages))
        self._prune()

    def get(self, tenant: str, rid: str) -> Stored | None:
        self._prune()
        item = self._items.get((tenant, rid))
        if item is None:
            return None
        return Stored(orjson.loads(item[1]), orjson.loads(item[2]))

    def delete(self, tenant: str, rid: str) -> bool:
        return self._items.pop((tenant, rid), None) is not None

    def close(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def _prune(self) -> None:
        oldest = self.clock() - self.retention.max_age_s
        items = self._items
        while items and (len(items) > self.retention.max_count
                         or next(iter(items.values()))[0] < oldest):
            items.popitem(last=False)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    created_at REAL NOT NULL,
    response BLOB NOT NULL,
    messages BLOB NOT NULL,
    UNIQUE (tenant, id)
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
"""


class SqliteStore:
    """Stored responses in SQLite (WAL, `synchronous=NORMAL`, as the batch tier's store)."""

    durable = True

    def __init__(self, path: Path, retention: Retention,
                 clock: Callable[[], float] = time.time) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.retention = retention
        self.clock = clock
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)

    def put(self, tenant: str, rid: str, response: dict[str, Any],
            messages: list[dict[str, Any]]) -> None:
        now = self.clock()
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("INSERT OR REPLACE INTO responses (id, tenant, created_at, response,"
                            " messages) VALUES (?, ?, ?, ?, ?)",
                            (rid, tenant, now, orjson.dumps(response), orjson.dumps(messages)))
            self.db.execute("DELETE FROM responses WHERE created_at < ?",
                            (now - self.retention.max_age_s,))
            self.db.execute("DELETE FROM responses WHERE seq <= (SELECT MAX(seq) FROM responses)"
                            " - ?", (self.retention.max_count,))

    def get(self, tenant: str, rid: str) -> Stored | None:
        row = self.db.execute(
            "SELECT response, messages FROM responses WHERE tenant = ? AND id = ? AND "
            "created_at >= ?", (tenant, rid, self.clock() - self.retention.max_age_s)
        ).fetchone()
        return None if row is None else Stored(orjson.loads(row[0]), orjson.loads(row[1]))

    def delete(self, tenant: str, rid: str) -> bool:
        cur = self.db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, rid))
        return cur.rowcount > 0

    def close(self) -> None:
        self.db.close()


def open_store(data_dir: Path | None, retention: Retention) -> ResponseStore:
    if data_dir is None:
        return MemoryStore(retention)
    return SqliteStore(data_dir / "responses.sqlite3", retention)


def add_responses_serve_args(p: argparse.ArgumentParser) -> None:
    """The stored responses' `batcher serve` flags."""
    g = p.add_argument_group("stored responses (/v1/responses with store: true)")
    d = Retention()
    g.add_argument("--responses-max-stored", type=int, default=d.max_count,
                   help="responses kept for previous_response_id and GET, over all tenants; "
                   "the oldest go first (default: %(default)s). Kept in "
                   "DATA_DIR/responses.sqlite3 with --data-dir, else in memory")
    g.add_argument("--responses-max-age", type=float, default=d.max_age_s,
                   help="seconds a stored response is kept (default: %(default)s, 30 days)")


def retention_from_args(args: argparse.Namespace) -> Retention:
    """ValueError on bad values."""
    return Retention(args.responses_max_stored, args.responses_max_age).validate()
