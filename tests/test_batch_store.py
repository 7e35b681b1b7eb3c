"""The batch tier's input parsing and SQLite store: limits, tenant scoping, exactly-once results,
pagination, and state that survives reopening the database."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from batcher.batch.jsonl import parse_input
from batcher.batch.store import BatchStore


def jsonl(*items: object) -> bytes:
    return b"\n".join(orjson.dumps(i) for i in items) + b"\n"


def req(cid: str, url: str = "/v1/completions", **body: object) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url,
            "body": {"model": "m", "prompt": "hi", **body}}


def test_parse_accepts_a_valid_file() -> None:
    lines, problems = parse_input(jsonl(req("a"), req("b")) + b"\n\n")
    assert problems == []
    assert [(ln.index, ln.custom_id, ln.url) for ln in lines] == [
        (0, "a", "/v1/completions"), (1, "b", "/v1/completions")]


@pytest.mark.parametrize("data, code, line", [
    (b"", "empty_file", None),
    (b"{not json}\n", "invalid_json", 1),
    (jsonl([1, 2]), "invalid_request", 1),
    (jsonl(req("a"), req("a")), "duplicate_custom_id", 2),
    (jsonl({**req("a"), "custom_id": ""}), "invalid_custom_id", 1),
    (jsonl({**req("a"), "method": "GET"}), "invalid_method", 1),
    (jsonl(req("a", url="/v1/other")), "invalid_url", 1),
    (jsonl({**req("a"), "body": "text"}), "invalid_body", 1),
    (jsonl(req("a", stream=True)), "invalid_body", 1),
    (jsonl(req("a"), req("b", url="/v1/chat/completions")), "mixed_urls", None),
])
def test_parse_names_the_problem_and_line(data: bytes, code: str, line: int | None) -> None:
    _, problems = parse_input(data)
    assert problems and problems[0].code == code and problems[0].line == line


def test_parse_checks_the_endpoint_and_the_line_count() -> None:
    _, problems = parse_input(jsonl(req("a")), endpoint="/v1/chat/completions")
    assert [p.code for p in problems] == ["mismatched_url"]
    lines, problems = parse_input(jsonl(req("a"), req("b"), req("c")), max_lines=2)
    assert lines == [] and [p.code for p in problems] == ["too_many_requests"]


def make_store(tmp_path: Path, clock: list[float] | None = None) -> BatchStore:
    t = clock or [1000.0]
    return BatchStore(tmp_path / "data", clock=lambda: t[0])


def add_file(store: BatchStore, tenant: str, data: bytes, name: str = "in.jsonl"):
    temp = store.temp_path()
    temp.write_bytes(data)
    return store.add_file(tenant, name, "batch", temp, len(data))


def test_files_are_scoped_by_tenant(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    mine = add_file(store, "acme", b"x")
    assert store.get_file("acme", mine.id) == mine
    assert store.get_file("other", mine.id) is None
    assert store.list_files("other", 10) == ([], False)
    assert not store.delete_file("other", mine.id)
    assert store.path(mine.id).read_bytes() == b"x"
    assert store.delete_file("acme", mine.id)
    assert not store.path(mine.id).exists() and store.get_file("acme", mine.id) is None


def test_file_pages_follow_the_cursor(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    ids = [add_file(store, "acme", b"x").id for _ in range(5)]
    add_file(store, "other", b"y")
    page, more = store.list_files("acme", 2)
    assert [f.id for f in page] == ids[::-1][:2] and more
    page, more = store.list_files("acme", 2, after=page[-1].id)
    assert [f.id for f in page] == ids[::-1][2:4] and more
    page, more = store.list_files("acme", 2, after=page[-1].id)
    assert [f.id for f in page] == ids[:1] and not more
    page, _ = store.list_files("acme", 10, ascending=True)
    assert [f.id for f in page] == ids


def test_each_line_is_recorded_once_and_survives_reopening(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    f = add_file(store, "acme", b"")
    lines, _ = parse_input(jsonl(req("a"), req("b"), req("c")))
    b = store.create_batch("acme", "/v1/completions", f.id, "24h", 86400, {"k": "v"}, lines)
    assert b.status == "in_progress" and b.total == 3 and b.expires_at == 1000 + 86400
    assert store.get_batch("other", b.id) is None
    assert store.record_result(b.id, 1, 200, b'{"ok":1}', 7)
    assert not store.record_result(b.id, 1, 200, b'{"ok":2}', 7)  # already answered
    assert store.record_result(b.id, 2, 400, b'{"err":1}', 0)
    store.close()

    again = make_store(tmp_path)
    rec = again.get_batch("acme", b.id)
    assert rec is not None
    assert (rec.completed, rec.failed, rec.tokens) == (1, 1, 7)
    assert rec.metadata == {"k": "v"}
    assert again.pending_indices(b.id) == [0]
    assert [(c, s, o) for c, s, o in again.outputs(b.id)] == [
        ("a", None, None), ("b", 200, b'{"ok":1}'), ("c", 400, b'{"err":1}')]
    assert [r.id for r in again.active_batches()] == [b.id]
    assert again.finish(b.id, "completed", None, None)
    assert not again.finish(b.id, "expired", None, None)  # a finished batch stays finished
    assert again.active_batches() == []
    done = again.get_batch("acme", b.id)
    assert done is not None and done.to_openai()["completed_at"] == 1000


def test_one_server_per_data_directory(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    with pytest.raises(RuntimeError, match="in use by another server"):
        make_store(tmp_path)
    store.close()
    make_store(tmp_path).close()  # free again once closed


def test_lines_are_read_in_blocks_and_a_long_one_is_skipped_not_held() -> None:
    import io

    from batcher.batch import jsonl as jsonl_mod

    data = b"ab\n" + b"x" * 50 + b"\n\ncd\n" + b"y" * 30 + b"\nlast"
    lines = list(jsonl_mod.iter_lines(io.BytesIO(data), max_line_bytes=20))
    assert lines == [(1, b"ab"), (2, None), (3, b""), (4, b"cd"), (5, None), (6, b"last")]
    # The same across block boundaries: a long line spanning several reads, then a short one.
    old = jsonl_mod._READ_BYTES
    jsonl_mod._READ_BYTES = 7
    try:
        assert list(jsonl_mod.iter_lines(io.BytesIO(data), max_line_bytes=20)) == lines
        assert list(jsonl_mod.iter_lines(io.BytesIO(b"z" * 30), 20)) == [(1, None)]
    finally:
        jsonl_mod._READ_BYTES = old


def test_a_line_past_the_size_or_depth_limit_is_a_problem_of_the_file() -> None:
    ok = req("a")
    data = jsonl(ok, req("b", prompt="p" * 300), ok | {"custom_id": "c"})
    lines, problems = parse_input(data, max_line_bytes=200)
    assert [(p.code, p.line) for p in problems] == [("line_too_large", 2)]
    deep = {"custom_id": "d", "url": "/v1/completions",
            "body": {"model": "m", "prompt": "x", "extra": [[[[[[[[1]]]]]]]]}}
    _, problems = parse_input(jsonl(deep))
    assert problems == []
    deep["body"]["extra"] = orjson.loads(b"[" * 62 + b"]" * 62)  # 64 deep in all: allowed
    _, problems = parse_input(jsonl(deep))
    assert problems == []
    deep["body"]["extra"] = "[" * 100 + "]" * 100  # brackets inside a string do not nest
    _, problems = parse_input(jsonl(deep))
    assert problems == []
    deep["body"]["extra"] = orjson.loads(b"[" * 70 + b"]" * 70)
    _, problems = parse_input(jsonl(deep))
    assert [(p.code, p.line) for p in problems] == [("json_too_deep", 1)]
    assert "more than 64 levels" in problems[0].message


def test_files_expire_and_count_against_their_tenant(tmp_path: Path) -> None:
    clock = [1000.0]
    store = make_store(tmp_path, clock)
    temp = store.temp_path()
    temp.write_bytes(b"abc")
    short = store.add_file("acme", "a.jsonl", "batch", temp, 3, expires_after_s=60)
    assert short.to_openai()["expires_at"] == 1060
    kept = add_file(store, "acme", b"defg")
    assert kept.to_openai()["expires_at"] is None
    assert store.usage("acme") == (2, 7) and store.usage("other") == (0, 0)
    clock[0] = 1060.0
    # Expired: gone from lookups at once, and from disk at the next housekeeping.
    assert store.get_file("acme", short.id) is None
    assert [f.id for f in store.list_files("acme", 10)[0]] == [kept.id]
    assert store.delete_expired_files() == 1
    assert not store.path(short.id).exists() and store.usage("acme") == (1, 4)
    assert store.delete_expired_files() == 0


def test_staged_lines_of_a_batch_never_opened_are_removed_at_open(tmp_path: Path) -> None:
    from batcher.batch.jsonl import InputLine
    from batcher.batch.line_rows import line_rows

    store = make_store(tmp_path)
    lines = [InputLine(0, "a", "/v1/completions", {"prompt": "x"}, cost=(3, 5)),
             InputLine(1, "b", "/v1/completions", {"prompt": "y"},
                       answer=(400, b'{"error":1}'))]
    store.stage_lines(line_rows("batch_crashed", lines))
    b = store.create_batch("acme", "/v1/completions", "file-x", "24h", 86400, None, lines)
    assert (b.total, b.failed) == (2, 1)
    assert store.pending_lines(b.id) == [(0, 3, 5)]  # the cost stored, the answered line done
    assert list(store.outputs(b.id))[1] == ("b", 400, b'{"error":1}')
    store.close()
    again = make_store(tmp_path)
    assert again.pending_lines("batch_crashed") == [] and again.pending_lines(b.id) == [(0, 3, 5)]


def test_a_database_from_before_costs_and_expiry_gains_their_columns(tmp_path: Path) -> None:
    import sqlite3

    root = tmp_path / "data"
    root.mkdir()
    db = sqlite3.connect(root / "batches.sqlite3")
    db.executescript("""
        CREATE TABLE files (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
            tenant TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
            bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
        CREATE TABLE lines (batch_id TEXT NOT NULL, idx INTEGER NOT NULL,
            custom_id TEXT NOT NULL, body BLOB NOT NULL, state TEXT NOT NULL DEFAULT 'pending',
            status_code INTEGER, output BLOB, PRIMARY KEY (batch_id, idx)) WITHOUT ROWID;
        INSERT INTO files (id, tenant, filename, purpose, bytes, created_at)
            VALUES ('file-old', 'acme', 'a.jsonl', 'batch', 3, 5);
    """)
    db.commit()
    db.close()
    store = make_store(tmp_path)
    old = store.get_file("acme", "file-old")
    assert old is not None and old.expires_at is None
