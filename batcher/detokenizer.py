"""The incremental detokenizer: sampled token ids to text deltas that are safe to stream: never
half a UTF-8 character, never the start of a stop string that may still complete, and nothing
after a stop string."""

from __future__ import annotations

from collections.abc import Sequence

from batcher.tokenizer import REPLACEMENT_CHAR, Tokenizer, incomplete_utf8_tail


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
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.stopped = False
        self.stop_reason: str | None = None
        # The window: context tokens `[:_read]` (already shown, or prompt) then unshown tokens.
        self._ids: list[int] = list(prompt_token_ids[-self.PROMPT_CONTEXT :])
        self._read = len(self._ids)
        self._context_text = self._decode(self._ids)
        self._pending = ""  # decoded, not yet emitted: a possible start of a stop string
        self._parts: list[str] = []
        self._text: str | None = ""

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
