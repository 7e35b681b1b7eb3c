"""Tokenizer and chat template.

`load_tokenizer` reads the tokenizer of the bundled GGUF model (converted once, then cached on disk)
or of a local Hugging Face folder. The text of generated tokens is streamed by `detokenizer.py`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

from batcher.bundled import cache_root
from batcher.tokenizer.tokenizer_json import JsonTokenizer, can_load

logger = logging.getLogger(__name__)

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
# End-of-turn markers of common chat formats; a chat model stops at whichever its vocabulary has.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>")
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A thin wrapper over a Hugging Face fast tokenizer with the few calls the server needs.

    Decoding never applies clean-up of tokenization spaces, so decoding a window of tokens and
    decoding the whole sequence agree (the incremental detokenizer depends on that)."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int] = ()) -> None:
        self.hf = hf_tokenizer
        ids: list[int] = []
        if hf_tokenizer.eos_token_id is not None:
            ids.append(int(hf_tokenizer.eos_token_id))
        ids.extend(int(i) for i in eos_token_ids)
        if getattr(hf_tokenizer, "chat_template", None):
            turn_ids = (_token_id(hf_tokenizer, t) for t in END_OF_TURN_TOKENS)
            ids.extend(i for i in turn_ids if i is not None)
        self._eos_token_ids = tuple(dict.fromkeys(ids))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end generation: the tokenizer's EOS plus, for chat models, the
        end-of-turn token (e.g. `<|im_end|>`) and any EOS ids from `generation_config.json`."""
        return self._eos_token_ids

    @property
    def chat_template(self) -> str | None:
        """The model's chat template text (a tool-call format needs one that renders tools)."""
        t = getattr(self.hf, "chat_template", None)
        return t if isinstance(t, str) else None

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (base vocabulary plus added tokens)."""
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def max_chars_per_token(self) -> int:
        """The most characters of text one token can stand for: the longest piece of the
        vocabulary (a byte-level piece is one character per byte, a SentencePiece one has one
        character per character of text, a byte-fallback piece six for one byte). A text of more
        than `max_chars_per_token x n` characters cannot fit in `n` tokens, which a server checks
        before paying for tokenizing it."""
        if not hasattr(self, "_max_chars"):
            vocab = self.hf.get_vocab()
            self._max_chars = max(1, max((len(p) for p in vocab), default=1))
        return self._max_chars

    def min_tokens(self, chars: int) -> int:
        """A lower bound on the tokens of any text of `chars` characters."""
        return -(-chars // self.max_chars_per_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds BOS/EOS where the tokenizer does so."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. An incomplete UTF-8 sequence at the end decodes as U+FFFD."""
        return self.hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Prompt token ids for a chat, ending with the assistant's turn header.

        `template_kwargs`: more variables for the template (`enable_thinking`, ...).

        `tools`: for a template with a tool format of its own, the tools it lists; then
        assistant messages may carry `tool_calls` (arguments as objects), which it renders.

        `messages` is a list of `{"role": system|user|assistant|tool, "content": str | [{"type":
        "text", "text": str}, ...]}`; text parts are joined with newlines. Raises ValueError on
        any other shape, or when the model has no chat template or its template rejects the chat."""
        chat = validate_messages(messages, tool_calls=tools is not None)
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model has no chat template; use the completions endpoint")
        try:
            extra = dict(template_kwargs or {})
            if tools is not None:
                extra["tools"] = tools
            text = self.hf.apply_chat_template(chat, add_generation_prompt=add_generation_prompt,
                                               tokenize=False, **extra)
        except Exception as exc:  # jinja2 TemplateError from the template's raise_exception()
            raise ValueError(f"messages rejected by the chat template: {exc}") from exc
        # The template writes BOS itself where the model wants one.
        return self.encode(text, add_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level piece may be part of a character, so its
        text alone can be U+FFFD): byte-level BPE pieces map back through the GPT-2 byte table,
        SentencePiece byte-fallback pieces (`<0xE2>`) are their byte, others are their text."""
        table = self._byte_table()
        piece = self.hf.convert_ids_to_tokens(int(token_id))
        if not isinstance(piece, str):
            return b""
        if table is not None and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if table is None:
            return piece.replace("\u2581", " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    def _byte_table(self) -> dict[str, int] | None:
        """Character -> byte of the GPT-2 byte-level alphabet, when this tokenizer uses it."""
        if not hasattr(self, "_bytes_of"):
            self._bytes_of: dict[str, int] | None = None
            backend = getattr(self.hf, "backend_tokenizer", None)
            if backend is not None and '"ByteLevel"' in backend.to_str():
                self._bytes_of = {c: b for b, c in _gpt2_byte_chars().items()}
        return self._bytes_of


def message_chars(messages: Any) -> int:
    """Characters of text a chat's messages carry (string contents and text parts, without the
    whitespace at their ends, which a template may trim): the chat template renders all of them,
    so the prompt has at least this many. Nothing else is counted, so the figure is a lower bound
    whatever the template does with other fields."""
    total = 0
    if not isinstance(messages, list):
        return 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content.strip())
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                if isinstance(text, str):
                    total += len(text.strip())
    return total


def incomplete_utf8_tail(data: bytes) -> bool:
    """Whether `data` ends with the start of a UTF-8 character whose other bytes are missing."""
    for k in range(1, min(4, len(data)) + 1):
        c = data[-k]
        if c & 0xC0 == 0x80:  # a continuation byte: look further back for the lead byte
            continue
        need = 2 if c & 0xE0 == 0xC0 else 3 if c & 0xF0 == 0xE0 else 4 if c & 0xF8 == 0xF0 else 1
        return need > k
    return False


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (a published table, rebuilt here):
    printable Latin-1 bytes stand for themselves, the rest take code points from 256 up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def validate_messages(messages: Any, tool_calls: bool = False) -> list[dict[str, Any]]:
    """Check a chat's shape; return it as `[{"role": ..., "content": str}]`. ValueError if bad.
    `tool_calls`: keep an assistant's `tool_calls` (for a template that renders them)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    chat: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{where} must be an object with 'role' and 'content'")  # noqa: TRY004
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}")
        calls = msg.get("tool_calls") if tool_calls and role == "assistant" else None
        if (msg.get("tool_calls") and calls is None) or msg.get("function_call"):
            # Dropping them would show the model a conversation that never happened.
            raise ValueError(f"{where}.tool_calls: tool calling is not supported by this server")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        content = msg.get("content")
        if calls is not None and content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise ValueError(
                        f"{where}.content[{j}] must be {{'type': 'text', 'text': <string>}}"
                    )
                parts.append(part["text"])
            content = "\n".join(parts)
        elif not isinstance(content, str):
            problem = f"{where}.content must be a string or a list of text parts"
            raise ValueError(problem)  # noqa: TRY004
        chat.append({"role": role, "content": content, **({"tool_calls": calls} if calls else {})})
    return chat


def load_tokenizer(
    source: str | os.PathLike[str] | None = None, *, cache_dir: Path | None = None
) -> Tokenizer:
    """Load a tokenizer without touching the network.

    `source` is a `.gguf` file (default: the bundled SmolLM2 model) or a local Hugging Face folder.
    Converting a GGUF vocabulary takes seconds, so the converted tokenizer is saved under
    `cache_dir` (default `tokenizers` in `batcher.bundled.cache_root()`),
    keyed by the file's name, size and mtime, and loaded from there next time (~0.25 s). A cached
    tokenizer that is a plain `tokenizer.json` is read without `transformers` (about 50 MiB less
    resident memory; `tokenizer_json`)."""
    if source is None:
        from batcher.bundled import smollm2_gguf_path

        source = smollm2_gguf_path()
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return Tokenizer(_load_gguf(path, cache_dir or default_cache_dir()))
    if not path.is_dir():
        raise FileNotFoundError(f"no tokenizer at {path}: expected a .gguf file or a folder")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return Tokenizer(hf, _generation_eos_ids(path))


def _token_id(hf_tokenizer: Any, token: str) -> int | None:
    """The id of one token string, or None. Asked of the Rust tokenizer where there is one: a
    whole `get_vocab()` dict of a 49k vocabulary left a few MiB resident for five lookups."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.token_to_id(token)
    return hf_tokenizer.get_vocab().get(token)


def default_cache_dir() -> Path:
    return cache_root() / "tokenizers"


def _load_cached(folder: Path) -> Any:
    """A cached converted tokenizer: without transformers where the folder allows it."""
    if can_load(folder):
        return JsonTokenizer(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _load_gguf(path: Path, cache_root: Path) -> Any:
    st = path.stat()
    # The converter's version from the package metadata: importing transformers to ask would
    # cost the memory that a warm cache avoids.
    key = f"{path.name}|{st.st_size}|{st.st_mtime_ns}|transformers-{version('transformers')}"
    cached = cache_root / hashlib.sha256(key.encode()).hexdigest()[:20]
    if cached.is_dir():
        try:
            return _load_cached(cached)
        except Exception as exc:  # noqa: BLE001 (a damaged cache entry: rebuild it)
            logger.warning("ignoring unreadable tokenizer cache %s: %s", cached, exc)
            shutil.rmtree(cached, ignore_errors=True)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    tmp: Path | None = None
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
        # Write to a temporary folder and rename, so concurrent processes never read half a cache.
        tmp = Path(tempfile.mkdtemp(dir=cache_root, prefix=".tmp-"))
        hf.save_pretrained(str(tmp))
        tmp.rename(cached)  # fails if another process got there first: its copy is as good
        tmp = None
    except OSError as exc:
        if not cached.is_dir():
            logger.warning("could not cache the converted tokenizer in %s: %s", cache_root, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if cached.is_dir():
        # The same reader as a warm cache, so a first run and later runs agree.
        try:
            return _load_cached(cached)
        except Exception as exc:  # noqa: BLE001 (the converted tokenizer below is as good)
            logger.warning("could not read the cached tokenizer %s: %s", cached, exc)
    return hf


def _generation_eos_ids(folder: Path) -> list[int]:
    """EOS ids a Hugging Face folder declares in generation_config.json (an int or a list)."""
    cfg = folder / "generation_config.json"
    if not cfg.is_file():
        return []
    eos = json.loads(cfg.read_text()).get("eos_token_id")
    if isinstance(eos, int):
        return [eos]
    return [int(i) for i in eos] if isinstance(eos, list) else []
