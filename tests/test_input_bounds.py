"""The pure helpers that bound client input: JSON depth, echoed text, filenames, error messages,
the per-caller retry budget and the tokenizer's lower bound on tokens."""

from __future__ import annotations

import pytest

from batcher.fleet.router.ratelimit import KeyedRetryBudget
from batcher.http.errors import MAX_MESSAGE_CHARS, ApiError, error_body
from batcher.http.text import MAX_FILENAME_CHARS, excerpt, safe_filename
from batcher.structured.json_limits import MAX_JSON_DEPTH, loads_bounded, too_deep


def test_depth_is_counted_in_lists_and_objects() -> None:
    assert not too_deep(1) and not too_deep("[[[[")
    assert not too_deep([[1]], 2) and too_deep([[[1]]], 2)
    assert too_deep({"a": {"b": [1]}}, 2) and not too_deep({"a": {"b": [1]}}, 3)
    deep = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    with pytest.raises(ValueError, match="levels deep"):
        loads_bounded(deep)
    with pytest.raises(ValueError, match="not valid JSON"):
        loads_bounded("[" * 5000 + "]" * 5000)
    assert loads_bounded('{"a": [1, {"b": 2}]}') == {"a": [1, {"b": 2}]}
    wide = [list(range(100)) for _ in range(100)]  # many brackets, shallow
    assert not too_deep(wide, 3)


def test_echoes_are_short_and_printable() -> None:
    text = excerpt("x" * 3_000_000)
    assert len(text) < 100 and text.endswith("(3000000 chars)")
    assert excerpt("a\r\nb\x1b\udcff").isprintable()
    assert len(ApiError(404, "no such file: " + "x" * 3_000_000).message) < MAX_MESSAGE_CHARS + 64
    assert len(error_body(400, "y" * 10_000)["error"]["message"]) < MAX_MESSAGE_CHARS + 64


def test_filenames_are_printable_and_bounded() -> None:
    assert safe_filename("a\r\nb.jsonl") == "a__b.jsonl"
    assert safe_filename("../../etc/passwd") == ".._.._etc_passwd"
    assert safe_filename("\udcff\udcfe.jsonl").isprintable()
    assert len(safe_filename("x" * 9000)) == MAX_FILENAME_CHARS
    assert safe_filename(None) == safe_filename("  ") == "upload.jsonl"


def test_retry_budget_is_kept_per_caller() -> None:
    b = KeyedRetryBudget(ratio=0.1, floor=3, window=10.0, max_keys=2)
    for i in range(20):
        b.note_request(i * 0.01, "alice")
    assert [b.try_spend(1.0, "alice") for _ in range(4)] == [True, True, True, False]
    assert b.try_spend(1.0, "bob")  # alice's retries are hers alone
    assert b.retries_in_window(1.0) == 4
    assert b.retries_in_window(20.0) == 0  # the window moved on
    b.note_request(20.0, "carol")  # a third caller: the least recently seen starts afresh
    assert len(b) == 2


def test_min_tokens_is_a_lower_bound() -> None:
    from batcher.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    for text in ("hello world", "a " * 500, "#" * 400, "\n" + " " * 300, "é" * 100):
        assert tok.min_tokens(len(text)) <= len(tok.encode(text, add_special_tokens=False))
