"""The tokenizer read from tokenizer.json without transformers gives the same tokens, text and chat
prompts as transformers' tokenizer of the same folder (the bundled SmolLM2 tokenizer)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from batcher.bundled import smollm2_gguf_path
from batcher.engine.detokenizer import IncrementalDetokenizer
from batcher.tokenizer.tokenizer import Tokenizer, load_tokenizer
from batcher.tokenizer.tokenizer_json import JsonTokenizer, can_load
from tests.test_tool_parsers import QWEN_LIKE, WEATHER

TEXTS = [
    "The capital of France is",
    "  leading and trailing spaces  \n\n\ttabs",
    "Café naïve façade — 😀🎉 日本語のテキスト, 한국어 👩‍👩‍👧 ñ ü ß Ω",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|> special tokens inline",
    "def f(x):\n    return x ** 2  # code\n",
    "",
]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café? 😀"},
     {"role": "assistant", "content": "Oui."}, {"role": "user", "content": "<b>&\"quotes\"</b>"}],
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Tokenizer]:
    """(ours, transformers') over the same cached folder."""
    from transformers import AutoTokenizer

    cache = tmp_path_factory.mktemp("tok-cache")
    ours = load_tokenizer(smollm2_gguf_path(), cache_dir=cache)
    (folder,) = list(cache.iterdir())
    theirs = Tokenizer(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
    return ours, theirs


def test_bundled_cache_is_read_without_transformers(pair: tuple[Tokenizer, Tokenizer]) -> None:
    ours, theirs = pair
    assert isinstance(ours.hf, JsonTokenizer)
    assert not isinstance(theirs.hf, JsonTokenizer)
    assert ours.eos_token_ids == theirs.eos_token_ids
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.vocab_size == theirs.vocab_size
    assert ours.hf.get_vocab() == theirs.hf.get_vocab()


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match(pair: tuple[Tokenizer, Tokenizer], text: str) -> None:
    ours, theirs = pair
    for special in (True, False):
        ids = theirs.encode(text, add_special_tokens=special)
        assert ours.encode(text, add_special_tokens=special) == ids
        for skip in (True, False):
            assert ours.decode(ids, skip) == theirs.decode(ids, skip)
    ids = theirs.encode(text)
    assert ours.hf.convert_ids_to_tokens(ids) == theirs.hf.convert_ids_to_tokens(ids)
    assert [ours.token_bytes(t) for t in ids] == [theirs.token_bytes(t) for t in ids]


def test_chat_templates_match(pair: tuple[Tokenizer, Tokenizer]) -> None:
    ours, theirs = pair
    for chat in CHATS:
        for gen in (True, False):
            assert ours.apply_chat_template(chat, gen) == theirs.apply_chat_template(chat, gen)
    # A template with a tool format: tools rendered through tojson (no HTML escaping).
    qwen_ours, qwen_theirs = Tokenizer(ours.hf), Tokenizer(theirs.hf)
    import copy

    qwen_ours.hf, qwen_theirs.hf = copy.copy(ours.hf), copy.copy(theirs.hf)
    qwen_ours.hf.chat_template = qwen_theirs.hf.chat_template = QWEN_LIKE
    chat = [*CHATS[1], {"role": "assistant", "content": "",
                        "tool_calls": [{"type": "function", "function": {
                            "name": "get_weather", "arguments": {"city": "Zürich <&>"}}}]},
            {"role": "tool", "content": "{\"temp\": 3}"}]
    got = qwen_ours.apply_chat_template(chat, tools=[WEATHER])
    assert got == qwen_theirs.apply_chat_template(chat, tools=[WEATHER])
    assert "Zürich <&>" in qwen_ours.decode(got, skip_special_tokens=False)


def test_template_errors_are_value_errors(pair: tuple[Tokenizer, Tokenizer]) -> None:
    ours, _ = pair
    import copy

    strict = Tokenizer(copy.copy(ours.hf))
    strict.hf.chat_template = "{{ raise_exception('only user turns') }}"
    with pytest.raises(ValueError, match="only user turns"):
        strict.apply_chat_template([{"role": "user", "content": "x"}])


def test_incremental_detokenization_matches(pair: tuple[Tokenizer, Tokenizer]) -> None:
    ours, theirs = pair
    prompt = theirs.apply_chat_template(CHATS[0])
    ids = theirs.encode(TEXTS[2] * 3 + TEXTS[4], add_special_tokens=False)
    streams = []
    for tok in (ours, theirs):
        detok = IncrementalDetokenizer(tok, prompt, stop=["テキ"])
        streams.append([detok.add([t]) for t in ids] + [detok.flush()])
    assert streams[0] == streams[1]
    assert "".join(streams[0]).endswith("日本語の")


def test_other_tokenizer_classes_use_transformers(tmp_path: Path,
                                                  pair: tuple[Tokenizer, Tokenizer]) -> None:
    ours, _ = pair
    ours.hf.save_pretrained(str(tmp_path))
    assert can_load(tmp_path)
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace('"TokenizersBackend"', '"LlamaTokenizerFast"'))
    assert not can_load(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    assert not can_load(tmp_path)


def test_serving_imports_no_transformers(pair: tuple[Tokenizer, Tokenizer], tmp_path: Path) -> None:
    """The server's modules and a warm-cache tokenizer load leave transformers unimported."""
    cache = tmp_path / "cache"
    load_tokenizer(smollm2_gguf_path(), cache_dir=cache)  # warm it
    code = ("import sys; import batcher.app.serve, batcher.models.loader, "
            "batcher.runtime.model_runner, batcher.runtime.grammar\n"
            "from pathlib import Path\nfrom batcher.tokenizer.tokenizer import load_tokenizer\n"
            f"tok = load_tokenizer(cache_dir=Path({str(cache)!r}))\n"
            "assert tok.encode('hi') and tok.apply_chat_template([{'role': 'user', "
            "'content': 'hi'}])\nprint(sorted(m for m in sys.modules if m.startswith('transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"
