"""The only handoff between the scheduler (`core/`) and the runner (`runtime/`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batcher.core.sampling import SamplingParams

# The input of a row scheduled before the step that samples it has run (`Scheduler.
# schedule_ahead`): the model thread puts that token in its place (`fill_pending_inputs`).
PENDING_TOKEN = -1


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's work in a step: compute KV for `token_ids` at positions
    `start_pos .. start_pos + len(token_ids) - 1`, reading and writing through `block_ids`
    (the whole block table, covering at least `start_pos + len(token_ids)` tokens).
    If `sample` is true, the last row's logits are sampled (the chunk reaches the sequence's
    end)."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    sampling: SamplingParams
    # Index of the token being sampled within the output (for seeded sampling that does not depend
    # on batch composition or preemption): len(output) at sampling time.
    output_index: int = 0
    # Token ids the sampler must not choose (stop tokens while under `min_tokens`).
    suppress: tuple[int, ...] = ()
    # The sequence's tokens so far (prompt then output) when a penalty needs them, else empty.
    # A snapshot: the request's own list grows while the runner reads this.
    history: tuple[int, ...] = ()
    # Prompt logprobs: rows `score_offset ..` of this chunk are scored, row j against
    # `score_targets[j - score_offset]` (the prompt token that follows it).
    score_targets: tuple[int, ...] = ()
    score_offset: int = 0
    # Speculation: proposed next tokens, also the tail of `token_ids` (after the one real new
    # token). The runner samples every position and keeps what `core/spec_verify` accepts.
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One new token: the same computation as a decode whatever its position (a one-token
        prompt, or the last prompt token after a full prefix-cache hit)."""
        return len(self.token_ids) == 1


@dataclass(slots=True)
class SchedulerOutput:
    """Sequences to run this step: the `num_decodes` decode rows first, then prefill chunks, each
    part in the order given. This is the one place that order is made; the runner relies on it."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    # IDs finished or preempted since the previous step: the runner may drop per-request state.
    freed_ids: list[str] = field(default_factory=list)
    # The requests those IDs named (`batcher.core.request.Request`, which imports this module),
    # in the same order: an ID may be in flight again under a new request by the time its report
    # is read.
    freed: list[Any] = field(default_factory=list)
    # Every row's input is PENDING_TOKEN: the token the step before samples for its request.
    inputs_pending: bool = False
    num_decodes: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        decodes = [s for s in self.seqs if len(s.token_ids) == 1]  # `is_decode`, inlined
        self.num_decodes = len(decodes)
        if 0 < len(decodes) < len(self.seqs):  # stable partition
            self.seqs = decodes + [s for s in self.seqs if not s.is_decode]

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def reads_prompt(self) -> bool:
        """Some sequence reads a prompt chunk: more new tokens than its one plus its drafts."""
        return any(len(s.token_ids) > 1 + len(s.draft_token_ids)
                   for s in self.seqs[self.num_decodes:])

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(slots=True)
class TokenLogprobs:
    """The sampled token's logprob and the top-k alternatives (token id, logprob)."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class RunnerOutput:
    """Sampled tokens for the sequences with `sample=True`, in the order they were scheduled.
    A sequence with drafts may have several entries in a row: its kept tokens, in order."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # Per request with `score_targets`: one entry per target, in order.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Requests the runner cannot go on with (a grammar over its time budget), with the reason:
    # the engine ends each with that error after this step.
    failed: dict[str, str] = field(default_factory=dict)


def fill_pending_inputs(sched: SchedulerOutput, before: RunnerOutput | None) -> None:
    """Put in each row of a step scheduled ahead (`inputs_pending`) the token that `before`, the
    step run just before it, sampled for its request; any other step is left as it is. No step
    before (it failed), or a row whose request `before` sampled nothing for, is raised here:
    never run with a placeholder id."""
    if not sched.inputs_pending:
        return
    if before is None:
        raise RuntimeError("a step scheduled ahead of a step that failed")
    sampled = dict(zip(before.request_ids, before.token_ids, strict=True))
    for seq in sched.seqs:
        token = sampled.get(seq.request_id)
        if token is None:
            raise RuntimeError(f"a row of {seq.request_id!r} was scheduled ahead of a step "
                               "that sampled no token for it")
        seq.token_ids[0] = token
    sched.inputs_pending = False
