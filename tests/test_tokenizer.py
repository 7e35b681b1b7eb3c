"""Tokenizer, chat template and incremental detokenizer, on the bundled SmolLM2 tokenizer."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batcher.bundled import smollm2_gguf_path
from batcher.engine.detokenizer import IncrementalDetokenizer, byte_level_table
from batcher.tokenizer.tokenizer import Tokenizer, load_tokenizer

MIXED_TEXT = "Café naïve façade — 😀🎉 日本語のテキスト, 한국어 👩‍👩‍👧 ñ ü ß Ω"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="module")
def tok(cache_dir: Path) -> Tokenizer:
    return load_tokenizer(smollm2_gguf_path(), cache_dir=cache_dir)


@pytest.fixture(scope="module")
def chat_prompt(tok: Tokenizer) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": "Say something."}])


def stream(
    tok: Tokenizer,
    prompt: Sequence[int],
    ids: Sequence[int],
    stop: Sequence[str] = (),
    step: int = 1,
    byte_level: bool = True,
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed `ids` `step` tokens at a time; return the detokenizer and every delta (flush last).
    `byte_level=False` takes the general path a tokenizer of another kind takes."""
    detok = IncrementalDetokenizer(tok, prompt, list(stop), byte_level=byte_level)
    deltas = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    return detok, deltas


# --- tokenizer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["Hello, world!", MIXED_TEXT, "  two  spaces\n\ttab\n", ""])
def test_encode_decode_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_basic_properties(tok: Tokenizer) -> None:
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tok.eos_token_ids
    assert tok.hf.eos_token_id in tok.eos_token_ids
    assert len(set(tok.eos_token_ids)) == len(tok.eos_token_ids)
    assert tok.vocab_size == 49152
    assert tok.bos_token_id is not None
    # Special tokens are dropped on decode unless asked for.
    assert tok.decode([im_end]) == ""
    assert tok.decode([im_end], skip_special_tokens=False) == "<|im_end|>"


def test_chat_template_uses_im_start_format(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "How are you?"}]},
    ]
    ids = tok.apply_chat_template(messages)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nHow are you?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # The markers are single special tokens, not spelled out in pieces.
    assert ids[0] == tok.hf.convert_tokens_to_ids("<|im_start|>")


def test_chat_template_text_parts_equal_string_content(tok: Tokenizer) -> None:
    as_parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    as_string = [{"role": "user", "content": "a\nb"}]
    assert tok.apply_chat_template(as_parts) == tok.apply_chat_template(as_string)


@pytest.mark.parametrize(
    "messages",
    [
        [],
        None,
        "hello",
        {"role": "user", "content": "hi"},
        ["hello"],
        [{"role": "robot", "content": "hi"}],
        [{"content": "hi"}],
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": 42}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "user", "content": ["plain string part"]}],
    ],
)
def test_invalid_messages_raise_value_error(tok: Tokenizer, messages: object) -> None:
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template(messages)


def test_gguf_tokenizer_is_cached_and_identical(tok: Tokenizer, cache_dir: Path) -> None:
    entries = [p for p in cache_dir.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()
    again = load_tokenizer(smollm2_gguf_path(), cache_dir=cache_dir)  # from the cache
    for text in ["Hello, world!", MIXED_TEXT, "<|im_start|>user\nx<|im_end|>"]:
        assert again.encode(text) == tok.encode(text)
    assert again.eos_token_ids == tok.eos_token_ids
    assert again.bos_token_id == tok.bos_token_id
    assert again.vocab_size == tok.vocab_size
    msgs = [{"role": "user", "content": "hi"}]
    assert again.apply_chat_template(msgs) == tok.apply_chat_template(msgs)


def test_damaged_cache_is_rebuilt(tmp_path: Path) -> None:
    first = load_tokenizer(smollm2_gguf_path(), cache_dir=tmp_path)
    (entry,) = list(tmp_path.iterdir())
    (entry / "tokenizer.json").write_text("{not json")
    again = load_tokenizer(smollm2_gguf_path(), cache_dir=tmp_path)
    assert again.encode(MIXED_TEXT) == first.encode(MIXED_TEXT)


def test_load_from_hf_folder_reads_generation_eos(tok: Tokenizer, tmp_path: Path) -> None:
    tok.hf.save_pretrained(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    folder_tok = load_tokenizer(tmp_path)
    assert folder_tok.encode(MIXED_TEXT) == tok.encode(MIXED_TEXT)
    assert set(folder_tok.eos_token_ids) == set(tok.eos_token_ids) | {0}


def test_missing_source_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nope")


# --- incremental detokenizer -------------------------------------------------------------------


def test_multibyte_text_streams_without_broken_characters(
    tok: Tokenizer, chat_prompt: list[int]
) -> None:
    ids = tok.encode(MIXED_TEXT, add_special_tokens=False)
    # The test only means something if some tokens carry part of a character.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok, deltas = stream(tok, chat_prompt, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == MIXED_TEXT
    assert detok.text == MIXED_TEXT
    assert not detok.stopped


@pytest.mark.parametrize("step", [1, 2, 3, 7])
@pytest.mark.parametrize("byte_level", [True, False])
def test_emoji_sequence_is_emitted_only_when_complete(tok: Tokenizer, step: int,
                                                      byte_level: bool) -> None:
    text = "😀👩‍👩‍👧🎉é日"
    ids = tok.encode(text, add_special_tokens=False)
    _, deltas = stream(tok, [], ids, step=step, byte_level=byte_level)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_stop_string_split_across_tokens(tok: Tokenizer, chat_prompt: list[int]) -> None:
    ids = tok.encode("Hello world, and then more text after it.", add_special_tokens=False)
    stop = "lo wor"  # spans the tokens "Hello" and " world"
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)
    detok = IncrementalDetokenizer(tok, chat_prompt, [stop])
    deltas = [detok.add([i]) for i in ids]
    assert detok.stopped and detok.stop_reason == stop
    assert "".join(deltas) == "Hel"
    assert detok.text == "Hel"
    # Nothing after the stop string, ever.
    assert detok.add(tok.encode(" more", add_special_tokens=False)) == ""
    assert detok.flush() == ""
    assert detok.text == "Hel"


def test_stop_string_inside_one_token_and_earliest_wins(tok: Tokenizer) -> None:
    ids = tok.encode("The answer is 42. Done. END", add_special_tokens=False)
    detok, deltas = stream(tok, [], ids, stop=["END", "Done", "answer"], step=4)
    assert detok.stop_reason == "answer"
    assert "".join(deltas) == "The "


def test_possible_stop_prefix_is_held_then_released(tok: Tokenizer) -> None:
    text = "Hello world! Bye"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], ["world peace", "Bye now"])
    emitted = ""
    for i in ids:
        emitted += detok.add([i])
        # "world" and "Bye" may still turn into stop strings: they are never shown early.
        assert not emitted.endswith(("world", "Bye"))
    assert emitted == "Hello world! "  # "Bye" could still become "Bye now"
    assert detok.flush() == "Bye"
    assert detok.text == text and not detok.stopped


def test_multibyte_stop_string(tok: Tokenizer) -> None:
    ids = tok.encode("Voilà 😀 fin ✅ ignored", add_special_tokens=False)
    detok, deltas = stream(tok, [], ids, stop=["😀 fin"])
    assert detok.stop_reason == "😀 fin"
    assert "".join(deltas) == "Voilà "
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("byte_level", [True, False])
def test_special_tokens_skipped_or_kept(tok: Tokenizer, byte_level: bool) -> None:
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    ids = [*tok.encode("Hi", add_special_tokens=False), im_end]
    assert "".join(stream(tok, [], ids, byte_level=byte_level)[1]) == "Hi"
    detok = IncrementalDetokenizer(tok, [], [], skip_special_tokens=False, byte_level=byte_level)
    assert detok.add(ids) + detok.flush() == "Hi<|im_end|>"
    # A special token inside a character's bytes is skipped as if it were not there.
    smile = tok.encode("😀", add_special_tokens=False)
    if len(smile) > 1:
        ids = [*smile[:1], im_end, *smile[1:]]
        assert "".join(stream(tok, [], ids, byte_level=byte_level)[1]) == tok.decode(ids)


@pytest.mark.parametrize("byte_level", [True, False])
def test_incomplete_character_at_the_end_is_dropped(tok: Tokenizer, byte_level: bool) -> None:
    ids = tok.encode("ok 😀", add_special_tokens=False)
    partial = ids[:-1]  # generation cut in the middle of the emoji
    assert tok.decode(partial).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, [], [], byte_level=byte_level)
    shown = "".join(detok.add([i]) for i in partial)
    assert "\ufffd" not in shown
    # The bytes of a character that never completed are dropped, not shown as U+FFFD.
    assert shown + detok.flush() == "ok "
    assert detok.text == "ok "


class _CountingTokenizer(Tokenizer):
    """Records how many ids each decode call sees."""

    def __init__(self, inner: Tokenizer) -> None:
        super().__init__(inner.hf)
        self.sizes: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return super().decode(ids, skip_special_tokens)


def test_work_per_step_does_not_grow_with_output(tok: Tokenizer, chat_prompt: list[int]) -> None:
    counting = _CountingTokenizer(tok)
    ids = tok.encode(MIXED_TEXT * 40, add_special_tokens=False)
    assert len(ids) > 1000
    _, deltas = stream(counting, chat_prompt, ids, stop=["never appears"], byte_level=False)
    assert "".join(deltas) == MIXED_TEXT * 40
    assert max(counting.sizes) <= 16
    # The byte-level path (this tokenizer's) decodes ordinary tokens without the library.
    counting.sizes.clear()
    _, deltas = stream(counting, chat_prompt, ids, stop=["never appears"])
    assert "".join(deltas) == MIXED_TEXT * 40 and not counting.sizes


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=60), step=st.integers(min_value=1, max_value=4),
       byte_level=st.booleans())
def test_streaming_equals_one_shot_decode(
    tok: Tokenizer, chat_prompt: list[int], text: str, step: int, byte_level: bool
) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    _, deltas = stream(tok, chat_prompt, ids, step=step, byte_level=byte_level)
    one_shot = tok.decode(ids)
    assert "".join(deltas) == one_shot
    # A delta shows U+FFFD only where the whole decode has one (text the vocabulary cannot spell).
    if "\ufffd" not in one_shot:
        assert all("\ufffd" not in d for d in deltas)


_ALPHABET = st.sampled_from(list("ab cdé\n.,!?") + ["😀", "日", "本", "ñ", "👩‍👧", "ß"])


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), step=st.integers(min_value=1, max_value=3), byte_level=st.booleans())
def test_stop_strings_cut_at_the_first_occurrence(
    tok: Tokenizer, data: st.DataObject, step: int, byte_level: bool
) -> None:
    text = "".join(data.draw(st.lists(_ALPHABET, min_size=1, max_size=40)))
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    # Stop strings: pieces of the text (so they occur) and random short strings (they may not).
    stops = data.draw(
        st.lists(
            st.one_of(
                st.builds(lambda i, n: full[i : i + n], st.integers(0, 40), st.integers(1, 5)),
                st.lists(_ALPHABET, min_size=1, max_size=3).map("".join),
            ),
            max_size=3,
        )
    )
    stops = [s for s in stops if s]
    detok, deltas = stream(tok, [], ids, stop=stops, step=step, byte_level=byte_level)
    hits = [full.find(s) for s in stops if s in full]
    expected = full[: min(hits)] if hits else full
    assert "".join(deltas) == expected == detok.text
    assert detok.stopped == bool(hits)
    if hits:
        assert detok.stop_reason in stops and full.find(detok.stop_reason) == min(hits)
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize(("text", "stops", "shown", "reason"), [
    ("👩\u200d👧 ok", ["\u200d", "👩\u200d👧"], "", "👩\u200d👧"),  # the longer began first
    ("xab and more", ["b", "ab"], "x", "ab"),
    ("xabd and more", ["b", "abc"], "xa", "b"),  # the longer never completes
    ("xab", ["b", "abc"], "xa", "b"),  # decided at the end of generation
])
@pytest.mark.parametrize("byte_level", [True, False])
def test_overlapping_stop_strings_the_earliest_wins(tok: Tokenizer, text: str, stops: list[str],
                                                    shown: str, reason: str,
                                                    byte_level: bool) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok, deltas = stream(tok, [], ids, stop=stops, byte_level=byte_level)
    assert "".join(deltas) == shown == detok.text
    assert detok.stopped and detok.stop_reason == reason


def test_byte_level_table_decodes_as_the_tokenizer_does(tok: Tokenizer) -> None:
    table = byte_level_table(tok)
    assert table is not None  # the bundled tokenizer is byte-level BPE
    assert table.special_ids and all(table.token_bytes[i] is None for i in table.special_ids)
    rng = random.Random(0)
    ordinary = [i for i, b in enumerate(table.token_bytes) if b is not None]
    mixed = tok.encode(MIXED_TEXT, add_special_tokens=False)
    for n in range(400):
        if n % 2:
            ids = [rng.choice(ordinary) for _ in range(rng.randint(1, 8))]
        else:
            start = rng.randrange(len(mixed))
            ids = mixed[start:start + rng.randint(1, 6)]
        joined = b"".join(table.token_bytes[i] or b"" for i in ids)
        assert joined.decode("utf-8", "replace") == tok.decode(ids), ids


def test_every_cache_follows_one_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Converted tokenizers sit under the same root as dense weights and built kernels:
    `$BATCHER_CACHE` moves them all (a read-only home needs only that one setting)."""
    from batcher.bundled import cache_root
    from batcher.tokenizer.tokenizer import default_cache_dir

    monkeypatch.setenv("BATCHER_CACHE", str(tmp_path / "all"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "all" / "tokenizers"
    assert cache_root() == tmp_path / "all"
    monkeypatch.delenv("BATCHER_CACHE")
    assert default_cache_dir() == tmp_path / "xdg" / "batcher" / "tokenizers"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "batcher"
