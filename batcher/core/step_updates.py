"""What a scheduler step reports: per-request updates, and the scheduler's cumulative counters."""

from __future__ import annotations

from dataclasses import dataclass

from batcher.core.outputs import TokenLogprobs
from batcher.core.request import RequestStatus


@dataclass(slots=True)
class RequestUpdate:
    """What one step produced for one request: new tokens (and logprobs), and its status after
    them (`finished` once it stopped; its blocks are already freed then)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    status: RequestStatus
    # With the first sampled token of a request that asked: its prompt's entries.
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason


@dataclass(slots=True)
class SchedulerStats:
    """Cumulative counters (metrics take differences)."""

    preemptions: int = 0
    prompt_tokens_computed: int = 0  # prompt positions run through the model, recompute included
    generated_tokens: int = 0
    steps: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    spec_draft_tokens: int = 0  # tokens proposed by speculation and checked by the model
    spec_accepted_tokens: int = 0  # of those, the ones the model agreed with
