"""Draft tokens by n-gram prompt lookup: speculation without a draft model.

Text that repeats itself (code edits, summaries quoting their source, lists, templates) continues
the way it continued before. For a sequence's own tokens (prompt + output), find the most recent
earlier occurrence of its last n tokens (longest n first) and propose the tokens that followed
it. The model then checks all of them in one step (`batcher.core.spec_verify`); a wrong proposal
costs a few extra query rows, never a wrong token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from batcher.core.sampling import SamplingParams


@dataclass(slots=True, frozen=True)
class NgramProposer:
    """Proposes up to `k` tokens per call. `max_n`..`min_n`: the n-gram lengths tried, longest
    first (a longer match predicts better). `window`: how many of the latest tokens are searched,
    so a step's cost stays bounded on long contexts.

    NOTE: `min_n` is 2: replayed on the bundled model's own greedy outputs, one-token matches
    (a comma, "the") more than tripled the drafts on free prose for a handful more accepted,
    and added almost nothing on text that repeats its prompt (`python -m scripts.bench speculative`)."""

    k: int
    max_n: int = 3
    min_n: int = 2
    window: int = 1024

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError("n-gram lengths must satisfy 1 <= min_n <= max_n")
        if self.window <= self.max_n:
            raise ValueError("the lookup window must be longer than max_n")

    def propose(self, tokens: Sequence[int], k: int | None = None) -> list[int]:
        """Up to `k` (default `self.k`) tokens that followed the latest earlier occurrence of the
        longest matching suffix of `tokens`; [] when no suffix of `min_n` or more tokens recurs."""
        k = self.k if k is None else min(k, self.k)
        size = len(tokens)
        if k <= 0 or size < self.min_n + 1:
            return []
        lo = max(0, size - self.window)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            tail = list(tokens[size - n:])
            last = tail[-1]
            # Candidate ends `e` of an earlier occurrence (tokens[e - n + 1 : e + 1] == tail),
            # latest first; e < size - 1 so at least one token follows it.
            for end in range(size - 2, lo + n - 2, -1):
                if tokens[end] == last and list(tokens[end - n + 1 : end + 1]) == tail:
                    return list(tokens[end + 1 : end + 1 + k])
        return []


def can_speculate(sp: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request's next tokens may be drafted and verified together. Not for grammar
    rows (their mask at each position depends on the tokens before it) nor while `min_tokens`
    still bans stop tokens (the ban would change within the drafted span)."""
    return sp.grammar is None and num_output_tokens >= sp.min_tokens
