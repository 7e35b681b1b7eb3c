"""The incremental detokenizer: sampled token ids to text deltas that are safe to stream: never
half a UTF-8 character, never the start of a stop string that may still complete, and nothing
after a stop string."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from batcher.tokenizer.tokenizer import REPLACEMENT_CHAR, Tokenizer, _gpt2_byte_chars, incomplete_utf8_tail


@dataclass(frozen=True, slots=True)
class ByteLevelTable:
    """A byte-level BPE tokenizer's tokens as bytes (`byte_level_table`)."""

    token_bytes: tuple[bytes | None, ...]  # None: an added token
    special_ids: frozenset[int]
    # Each token's text where its bytes are ASCII alone (whole characters whatever comes
    # next), else None: most tokens' text without a decode.
    ascii_text: tuple[str | None, ...] = ()


@functools.lru_cache(maxsize=8)
def byte_level_table(tokenizer: Tokenizer) -> ByteLevelTable | None:
    """The bytes of every ordinary token of a byte-level BPE tokenizer (GPT-2's alphabet and a
    `ByteLevel` decoder alone), None for added tokens; None when the tokenizer is not of that
    kind. Such a tokenizer decodes ordinary tokens as their bytes joined and read as UTF-8 (an
    invalid or cut sequence as U+FFFD), whatever came before them: exactly what the table gives
    without a call into the tokenizer library."""
    backend = getattr(tokenizer.hf, "backend_tokenizer", None)
    if backend is None or type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
        return None
    added = backend.get_added_tokens_decoder()
    chars = _gpt2_byte_chars()
    alphabet = frozenset(chars.values())
    to_latin1 = str.maketrans({c: chr(b) for b, c in chars.items()})
    table: list[bytes | None] = [None] * len(tokenizer.hf)
    for piece, i in backend.get_vocab(with_added_tokens=False).items():
        # A piece outside the byte alphabet is left to the tokenizer.
        if i not in added and i < len(table) and alphabet.issuperset(piece):
            table[i] = piece.translate(to_latin1).encode("latin-1")
    return ByteLevelTable(tuple(table), frozenset(i for i, t in added.items() if t.special),
                          tuple(b.decode("ascii") if b is not None and b.isascii() else None
                                for b in table))


def complete_prefix_len(data: bytes) -> int:
    """How many leading bytes of `data` hold whole characters: all but the start of a last
    character whose other bytes are still to come."""
    if not data or data[-1] < 0x80:
        return len(data)
    for k in range(1, min(4, len(data)) + 1):
        c = data[-k]
        if c & 0xC0 == 0x80:  # a continuation byte: look further back for the lead byte
            continue
        need = 2 if c & 0xE0 == 0xC0 else 3 if c & 0xF0 == 0xE0 else 4 if c & 0xF8 == 0xF0 else 1
        return len(data) - k if need > k else len(data)
    return len(data)


class IncrementalDetokenizer:
    """Streams the text of generated tokens, one `add` per step, in O(new tokens) per call.

    Each call decodes only a short window: the tokens not yet shown plus the few shown last,
    decoded before them as context; the new text is the difference between the two decodes (a
    tokenizer may render a token differently at the start of a string, e.g. SentencePiece's
    leading space, so a token is never decoded alone). A character whose bytes have not all
    arrived decodes as a trailing U+FFFD: the text is cut at the last token boundary before it and
    the rest waits for the next tokens. On the text side, the longest suffix that could still grow
    into a stop string is held back; when a stop string appears, `stopped` becomes true,
    `stop_reason` names it, the text before it is emitted, and nothing after it ever is. `flush()`
    at the end releases whatever was held back. Concatenating every delta gives `text`."""

    # Prompt tokens decoded as context for the first output tokens.
    PROMPT_CONTEXT = 5
    # The bytes of an incomplete character (at most 3) lie in at most this many trailing tokens.
    MAX_PARTIAL_TOKENS = 3
    # Unshown tokens after which the text before the last few is shown even if it ends in U+FFFD.
    MAX_PENDING_TOKENS = 8

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        byte_level: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.stopped = False
        self.stop_reason: str | None = None
        self._pending = ""  # decoded, not yet emitted: a possible start of a stop string
        self._parts: list[str] = []
        self._text: str | None = ""
        # A byte-level tokenizer's text is its tokens' bytes, whatever came before them: no
        # window, no context, just the bytes of a character not yet complete (`_add_bytes`).
        self._table = byte_level_table(tokenizer) if byte_level else None
        self._tail = b""
        if self._table is not None:
            self._ids: list[int] = []
            self._read = 0
            self._context_text = ""
            return
        # The window: context tokens `[:_read]` (already shown, or prompt) then unshown tokens.
        self._ids: list[int] = list(prompt_token_ids[-self.PROMPT_CONTEXT :])
        self._read = len(self._ids)
        self._context_text = self._decode(self._ids)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if self._text is None:
            self._text = "".join(self._parts)
            self._parts = [self._text]
        return self._text

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the text that may be shown now ("" once stopped)."""
        if self.stopped or not token_ids:
            return ""
        if self._table is not None:
            return self._add_bytes(token_ids)
        self._ids.extend(token_ids)
        end = len(self._ids)
        # Emit up to the latest token boundary that does not split a character.
        for upto in range(end, max(self._read, end - self.MAX_PARTIAL_TOKENS - 1), -1):
            window = self._decode(self._ids[:upto])
            if not window.endswith(REPLACEMENT_CHAR):
                return self._advance(window, upto)
        if end - self._read >= self.MAX_PENDING_TOKENS:
            # Invalid bytes, not a character in progress: show them (as U+FFFD, like a one-shot
            # decode), keeping only the last tokens, which may still hold a character's start.
            upto = end - self.MAX_PARTIAL_TOKENS
            return self._advance(self._decode(self._ids[:upto]), upto)
        return ""  # a character is still incomplete

    def flush(self) -> str:
        """Release held-back text at the end of generation (not needed after a stop). The bytes
        of a character that never completed (a length cut mid-character) are dropped, not shown
        as U+FFFD."""
        if self.stopped:
            return ""
        delta = ""
        self._tail = b""  # byte-level: the start of a character that never completed
        if self._read < len(self._ids):
            window = self._decode(self._ids)
            if window.endswith(REPLACEMENT_CHAR) and self._incomplete_tail():
                # One U+FFFD stands for the truncated character (a lossy UTF-8 decode gives one
                # per truncated sequence); a U+FFFD the whole decode has elsewhere stays.
                window = window[: max(len(window) - 1, len(self._context_text))]
            delta = self._advance(window, len(self._ids))
        if not self.stopped and self._pending:
            pending, self._pending = self._pending, ""
            delta += self._check_stop(pending, final=True)
            if not self.stopped and self._pending:  # a prefix that never completed
                delta += self._emit(self._pending)
                self._pending = ""
        return delta

    def _add_bytes(self, token_ids: Sequence[int]) -> str:
        """`add` for a byte-level tokenizer: the new tokens' bytes after those of a character
        still incomplete; the text is every whole character, the rest waits. A special token
        skipped is no bytes; an added one is its own text, after the bytes before it (a
        character cut by it is U+FFFD, as in a decode of the whole)."""
        table = self._table
        assert table is not None
        if len(token_ids) == 1 and not self._tail:
            # NOTE: the common case, one token whose bytes are whole ASCII characters.
            t = token_ids[0]
            text = table.ascii_text[t] if 0 <= t < len(table.ascii_text) else None
            if text is not None:
                if not text:
                    return ""
                if not self.stop:
                    self._parts.append(text)
                    self._text = None
                    return text
                return self._check_stop(self._pending + text)
        data, text = self._tail, ""
        for t in token_ids:
            piece = table.token_bytes[t] if 0 <= t < len(table.token_bytes) else None
            if piece is None:
                if self.skip_special_tokens and t in table.special_ids:
                    continue
                text += data.decode("utf-8", "replace") + self.tokenizer.decode(
                    [t], skip_special_tokens=self.skip_special_tokens)
                data = b""
                continue
            data += piece
        cut = complete_prefix_len(data)
        if cut:
            text += data[:cut].decode("utf-8", "replace")
        self._tail = data[cut:]
        return self._check_stop(self._pending + text) if text else ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _incomplete_tail(self) -> bool:
        """Whether the unshown tokens' bytes end inside a UTF-8 character."""
        tail = b"".join(self.tokenizer.token_bytes(t) for t in self._ids[self._read:])
        return incomplete_utf8_tail(tail)

    def _advance(self, window: str, upto: int) -> str:
        """`window` = decode of `_ids[:upto]`. Take its new text, make `_ids[_read:upto]` the next
        context, and pass the text on to the stop-string check."""
        new_text = window[len(self._context_text) :]
        del self._ids[: self._read]  # the old context is no longer needed
        self._read = upto - self._read
        self._context_text = self._decode(self._ids[: self._read])
        return self._check_stop(self._pending + new_text)

    def _check_stop(self, text: str, final: bool = False) -> str:
        """`text` = held-back text + new text. Emit what is safe; keep a possible stop prefix.
        `final`: no more text will come, so a stop found is the answer."""
        # A stop string cannot start in already-emitted text (its start would have been held back),
        # so searching `text` alone is enough. The earliest occurrence wins.
        hit, reason = -1, None
        for s in self.stop:
            pos = text.find(s)
            if pos != -1 and (hit == -1 or pos < hit):
                hit, reason = pos, s
        if reason is not None:
            # NOTE: a longer stop string may have begun before this hit and not be complete yet
            # (stops "b" and "ab" on "a", then "b"); the earliest occurrence must still win, so
            # wait for the next text before deciding.
            start = len(text) - self._stop_prefix_len(text)  # earliest unfinished stop
            if start >= hit or final:
                self.stopped, self.stop_reason = True, reason
                self._pending = ""
                return self._emit(text[:hit])
            self._pending = text[start:]
            return self._emit(text[:start])
        keep = self._stop_prefix_len(text)
        self._pending = text[len(text) - keep :] if keep else ""
        return self._emit(text[: len(text) - keep])

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _emit(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
            self._text = None
        return delta
