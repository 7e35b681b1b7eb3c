"""A tokenizer read straight from a `tokenizer.json` folder with the `tokenizers` library.

Importing `transformers` and building its tokenizer object costs a serving process about 50 MiB of
resident memory that encoding, decoding and chat templates never need when the folder holds a
plain `tokenizer.json`: its generic tokenizer classes add no Python-side rules of their own. This
class offers the few calls of a Hugging Face fast tokenizer the server makes, with the same
results (tests compare them), and renders chat templates the way `transformers` does: a sandboxed
Jinja environment, blocks trimmed, `tojson` without HTML escaping, `raise_exception` and
`strftime_now`, and the special tokens as variables.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

# Tokenizer classes whose whole behaviour is in tokenizer.json (no Python-side pre- or
# post-processing): a folder naming another class is loaded with transformers instead.
GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                 "mask_token")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def can_load(folder: Path) -> bool:
    """Whether `folder` holds a tokenizer this module reproduces exactly."""
    cfg = folder / "tokenizer_config.json"
    if not (folder / "tokenizer.json").is_file() or not cfg.is_file():
        return False
    config = json.loads(cfg.read_text())
    # Options that make transformers rewrite the post-processor or the text are not handled.
    if any(k in config for k in ("add_bos_token", "add_eos_token", "add_prefix_space",
                                 "added_tokens_decoder", "extra_special_tokens")):
        return False
    template = folder / "chat_template.jinja"
    if template.is_file() and GENERATION_TAG.search(template.read_text()):
        return False  # transformers' assistant-mask extension, not offered here
    return config.get("tokenizer_class") in GENERIC_CLASSES


class JsonTokenizer:
    """The Hugging Face fast tokenizer calls the server uses, over a `tokenizers.Tokenizer`."""

    __slots__ = ("_source", "backend_tokenizer", "chat_template", "special_tokens")

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        config = json.loads((folder / "tokenizer_config.json").read_text())
        self._source = folder
        self.backend_tokenizer = RustTokenizer.from_file(str(folder / "tokenizer.json"))
        template = folder / "chat_template.jinja"
        self.chat_template: str | None = (template.read_text() if template.is_file()
                                          else config.get("chat_template"))
        self.special_tokens: dict[str, str] = {
            k: v for k in SPECIAL_NAMES if isinstance(v := config.get(k), str)}

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend_tokenizer.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("clean-up of tokenization spaces is not supported")
        return str(self.backend_tokenizer.decode(list(ids),
                                                 skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> Any:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = False, tokenize: bool = False,
                            tools: list[dict[str, Any]] | None = None,
                            **template_kwargs: Any) -> str:
        """The chat rendered as text (tokenize=True is not offered: the caller encodes).
        `template_kwargs`: more template variables (`enable_thinking`, ...)."""
        if tokenize:
            raise ValueError("tokenize=True is not supported; encode the rendered text")
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return _compiled(self.chat_template).render(
            **(self.special_tokens | template_kwargs), messages=messages, tools=tools,
            documents=None, add_generation_prompt=add_generation_prompt)

    def save_pretrained(self, folder: str) -> None:
        """Copy the tokenizer's files into `folder` (readable by transformers too)."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            if (self._source / name).is_file():
                shutil.copyfile(self._source / name, out / name)


@lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    """The template compiled once per text, in the environment transformers renders it in."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)
