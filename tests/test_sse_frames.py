"""A streamed text chunk written from bytes made once per choice equals the chunk built as JSON."""

from __future__ import annotations

import orjson
import pytest

from batcher.http.sse import sse_event
from batcher.server.openai_routes import GenerationHandler


@pytest.mark.parametrize("chat", [False, True])
def test_text_frame_is_the_chunk_byte_for_byte(chat: bool) -> None:
    handler = GenerationHandler.__new__(GenerationHandler)
    handler.chat = chat
    base = {"id": 'cmpl-a"b\\c', "object": "text_completion", "created": 1700000000,
            "model": "m/é 日"}
    for index in (0, 7, 63):
        head, tail = handler._text_frame(base, index)
        for text in ("a", ' q"\\\n\t😀', "é日\u2028", "</script>"):
            assert head + orjson.dumps(text) + tail == sse_event(
                handler._chunk(base, index, text=text))
