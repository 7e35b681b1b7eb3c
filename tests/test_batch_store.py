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
