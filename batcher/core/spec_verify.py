"""Verifying drafted tokens with the request's own sampler.

A speculative row runs `[last token] + drafts` in one step, so the model yields a distribution
for each of the `k + 1` next positions. Position i is sampled exactly as a plain decode would
sample it if drafts `0..i-1` had been the chosen tokens: same sampling parameters, its own
`output_index` (seeded rows draw the same noise as without speculation), history including the
drafts before it. The row keeps the sampled tokens up to and including the first one that differs
from its draft: those are the tokens plain decoding would have produced one step at a time.

This is exact for every temperature, not only greedy: for a fixed draft token x, sampling
y ~ p and accepting when y == x accepts x with probability p(x), and on a mismatch y is already a
draw from p restricted to y != x, renormalised: the rejection rule for a deterministic proposal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from batcher.core.outputs import RunnerOutput, ScheduledSeq


def verify_rows(seq: ScheduledSeq) -> list[ScheduledSeq]:
    """The sampling rows of a scheduled sequence: itself when it drafted nothing, else one per
    position of `[last token] + drafts` (each as the plain decode of that position)."""
    drafts = seq.draft_token_ids
    if not drafts:
        return [seq]
    rows = []
    for i in range(len(drafts) + 1):
        history = seq.history + tuple(drafts[:i]) if seq.history else ()
        rows.append(replace(seq, output_index=seq.output_index + i, history=history))
    return rows


def accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many of the sampled tokens (`len(drafts) + 1` of them) a row keeps: the drafts the
    model agreed with, plus its own token at the first disagreement (or after the last draft)."""
    assert len(sampled) == len(drafts) + 1, (len(sampled), len(drafts))
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return n + 1


def collapse(seqs: Sequence[ScheduledSeq], tokens: Sequence[int], logprobs: Sequence[object]
             ) -> tuple[list[str], list[int], list]:
    """Fold the sampled rows of `verify_rows` (for each sampling seq in `seqs`, in order) back
    into the runner's output: per sequence, its kept tokens (and their logprobs), in order."""
    ids: list[str] = []
    kept: list[int] = []
    kept_lps: list = []
    row = 0
    for s in seqs:
        if not s.sample:
            continue
        n = len(s.draft_token_ids) + 1
        keep = accepted(s.draft_token_ids, tokens[row : row + n]) if n > 1 else 1
        ids += [s.request_id] * keep
        kept += tokens[row : row + keep]
        kept_lps += logprobs[row : row + keep]
        row += n
    assert row == len(tokens), (row, len(tokens))
    return ids, kept, kept_lps


def run_by_rule(seqs: Sequence[ScheduledSeq], next_token: Callable[[int, int], int]
                ) -> RunnerOutput:
    """A runner's output when each sampled position's token is `next_token(input token,
    position)` (fake and test runners): one row per drafted position, the last row otherwise,
    then the agreeing prefix kept by `collapse`."""
    tokens: list[int] = []
    for s in seqs:
        if s.sample:
            first = s.num_tokens - 1 - len(s.draft_token_ids)
            tokens += [next_token(s.token_ids[j], s.start_pos + j)
                       for j in range(first, s.num_tokens)]
    ids, kept, lps = collapse(seqs, tokens, [None] * len(tokens))
    return RunnerOutput(ids, kept, lps)
