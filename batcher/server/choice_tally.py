"""A generation job's choices as they finish: each choice's text, tokens and logprobs, and the
token counts of the usage block."""

from __future__ import annotations

import dataclasses
from typing import Any

from batcher.core.outputs import TokenLogprobs
from batcher.engine.events import EngineEvent
from batcher.server.protocol import usage


class Choice:
    """Accumulates one choice's text, tokens and logprobs."""

    __slots__ = ("final", "logprobs", "prompt_logprobs", "text", "tokens")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprobs | None] = []
        self.prompt_logprobs: list[TokenLogprobs] | None = None
        self.final: EngineEvent | None = None


def score_only(ev: EngineEvent) -> EngineEvent:
    """An event of a `max_tokens: 0` answer: the one token the engine sampled is dropped."""
    return dataclasses.replace(
        ev, text="", token_ids=[], logprobs=[], num_output_tokens=0, stop_reason=None,
        finish_reason="length" if ev.finish_reason in ("stop", "length") else ev.finish_reason)


class UsageTally:
    """Token counts of a job's finished choices; the n copies of one prompt count it once."""

    __slots__ = ("_seen", "cached", "completion", "n", "prompt")

    def __init__(self, n: int) -> None:
        self.n = n
        self.prompt = self.completion = self.cached = 0
        self._seen: set[int] = set()

    def add(self, index: int, final: EngineEvent) -> None:
        self.completion += final.num_output_tokens
        prompt = index // self.n
        if prompt not in self._seen:
            self._seen.add(prompt)
            self.prompt += final.num_prompt_tokens
            self.cached += final.num_cached_tokens

    def body(self) -> dict[str, Any]:
        return usage(self.prompt, self.completion, self.cached)
