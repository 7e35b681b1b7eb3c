"""Stored responses (`store: true`): per tenant, for `previous_response_id`, `GET` and `DELETE`.

Each entry is the response object and the conversation a later turn continues from (every
earlier turn's input and output as chat messages, without instructions). Every lookup filters by
tenant: another tenant's id is simply not found.

Where: `DATA_DIR/responses.sqlite3` when the server has a data directory (`--data-dir`), so
responses outlive a restart; otherwise a bounded in-memory store, lost on restart. Retention, on
both, oldest first out: at most `max_count` responses in all, at most `max_per_tenant` of one
tenant (so one tenant's many cheap `store: true` requests evict only its own), at most
`max_bytes` of stored JSON in all (a row's size: its response and conversation as stored), and
none older than `max_age_s`.
Calls are made from worker threads (`asyncio.to_thread`: SQLite and large JSON stay off the
event loop); each store takes a lock per call.
"""

from __future__ import annotations

import argparse
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import orjson

DAY_S = 86_400.0
MIB = 1 << 20


@dataclass(slots=True)
class Retention:
    max_count: int = 10_000
    max_age_s: float = 30 * DAY_S  # OpenAI keeps stored responses 30 days
    max_per_tenant: int = 2_000
    max_bytes: int = 256 * MIB

    def validate(self) -> Retention:
        if self.max_count < 1:
            raise ValueError("--responses-max-stored must be >= 1")
        if not self.max_age_s > 0:
            raise ValueError("--responses-max-age must be > 0 seconds")
        if self.max_per_tenant < 1:
            raise ValueError("--responses-max-stored-per-tenant must be >= 1")
        if self.max_bytes < 1:
            raise ValueError("--responses-max-bytes must be >= 1")
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
        self._tenants: dict[str, OrderedDict[str, None]] = {}  # each tenant's ids, oldest first
        self.bytes = 0  # the stored JSON of every item
        self._lock = threading.Lock()

    def put(self, tenant: str, rid: str, response: dict[str, Any],
            messages: list[dict[str, Any]]) -> None:
        # Kept as JSON bytes: a caller mutating what it passed or got never changes the store.
        item = (self.clock(), orjson.dumps(response), orjson.dumps(messages))
        with self._lock:
            self._put(tenant, rid, item)

    def _put(self, tenant: str, rid: str, item: tuple[float, bytes, bytes]) -> None:
        self._remove((tenant, rid))
        self._items[(tenant, rid)] = item
        self._tenants.setdefault(tenant, OrderedDict())[rid] = None
        self.bytes += len(item[1]) + len(item[2])
        own = self._tenants[tenant]
        while len(own) > self.retention.max_per_tenant:
            self._remove((tenant, next(iter(own))))
        self._prune()

    def get(self, tenant: str, rid: str) -> Stored | None:
        with self._lock:
            self._prune()
            item = self._items.get((tenant, rid))
        if item is None:
            return None
        return Stored(orjson.loads(item[1]), orjson.loads(item[2]))

    def delete(self, tenant: str, rid: str) -> bool:
        with self._lock:
            return self._remove((tenant, rid))

    def close(self) -> None:
        with self._lock:
            self._items.clear()
            self._tenants.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def _remove(self, key: tuple[str, str]) -> bool:
        item = self._items.pop(key, None)
        if item is None:
            return False
        self.bytes -= len(item[1]) + len(item[2])
        own = self._tenants[key[0]]
        del own[key[1]]
        if not own:
            del self._tenants[key[0]]
        return True

    def _prune(self) -> None:
        oldest = self.clock() - self.retention.max_age_s
        items, r = self._items, self.retention
        while items and (len(items) > r.max_count or self.bytes > r.max_bytes
                         or next(iter(items.values()))[0] < oldest):
            self._remove(next(iter(items)))


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
CREATE INDEX IF NOT EXISTS responses_by_tenant ON responses (tenant, seq);
"""
_SIZE = "length(response) + length(messages)"


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
        self.bytes = self.db.execute(f"SELECT COALESCE(SUM({_SIZE}), 0) FROM responses"
                                     ).fetchone()[0]
        self._lock = threading.Lock()  # one connection: one statement or transaction at a time

    def put(self, tenant: str, rid: str, response: dict[str, Any],
            messages: list[dict[str, Any]]) -> None:
        now, r = self.clock(), self.retention
        row = (orjson.dumps(response), orjson.dumps(messages))
        with self._lock, self.db:
            self.db.execute("BEGIN")
            gone = self._gone("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, rid))
            self.db.execute("INSERT INTO responses (id, tenant, created_at, response, messages)"
                            " VALUES (?, ?, ?, ?, ?)", (rid, tenant, now, *row))
            added = len(row[0]) + len(row[1])
            gone += self._gone("DELETE FROM responses WHERE created_at < ?",
                               (now - r.max_age_s,))
            gone += self._gone("DELETE FROM responses WHERE seq <= (SELECT MAX(seq) FROM "
                               "responses) - ?", (r.max_count,))
            gone += self._gone("DELETE FROM responses WHERE tenant = ? AND seq <= (SELECT seq "
                               "FROM responses WHERE tenant = ? ORDER BY seq DESC LIMIT 1 "
                               "OFFSET ?)", (tenant, tenant, r.max_per_tenant))
            total = self.bytes + added - gone
            if total > r.max_bytes:
                # The newest rows whose sizes sum to at most max_bytes stay.
                total -= self._gone(
                    f"DELETE FROM responses WHERE seq <= (SELECT seq FROM (SELECT seq, SUM("
                    f"{_SIZE}) OVER (ORDER BY seq DESC) AS kept FROM responses) WHERE kept > ?"
                    " ORDER BY seq DESC LIMIT 1)", (r.max_bytes,))
            self.bytes = total

    def _gone(self, sql: str, args: tuple[Any, ...]) -> int:
        """Run a DELETE; the summed size of the rows it removed."""
        return sum(n for (n,) in self.db.execute(f"{sql} RETURNING {_SIZE}", args).fetchall())

    def get(self, tenant: str, rid: str) -> Stored | None:
        with self._lock:
            row = self.db.execute(
                "SELECT response, messages FROM responses WHERE tenant = ? AND id = ? AND "
                "created_at >= ?", (tenant, rid, self.clock() - self.retention.max_age_s)
            ).fetchone()
        return None if row is None else Stored(orjson.loads(row[0]), orjson.loads(row[1]))

    def delete(self, tenant: str, rid: str) -> bool:
        with self._lock:
            gone = self.db.execute(f"DELETE FROM responses WHERE tenant = ? AND id = ? "
                                   f"RETURNING {_SIZE}", (tenant, rid)).fetchall()
            self.bytes -= sum(n for (n,) in gone)
        return bool(gone)

    def close(self) -> None:
        with self._lock:
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
                   "DATA_DIR/responses.sqlite3, or in memory with --no-batch-api")
    g.add_argument("--responses-max-stored-per-tenant", type=int, default=d.max_per_tenant,
                   help="responses kept for one tenant; its own oldest go first, so one "
                   "tenant cannot evict the others' (default: %(default)s)")
    g.add_argument("--responses-max-bytes", type=int, default=d.max_bytes,
                   help="bytes of stored responses and their conversations over all tenants; "
                   "the oldest go first (default: %(default)s, 256 MiB)")
    g.add_argument("--responses-max-age", type=float, default=d.max_age_s,
                   help="seconds a stored response is kept (default: %(default)s, 30 days)")


def retention_from_args(args: argparse.Namespace) -> Retention:
    """ValueError on bad values."""
    return Retention(args.responses_max_stored, args.responses_max_age,
                     args.responses_max_stored_per_tenant, args.responses_max_bytes).validate()
