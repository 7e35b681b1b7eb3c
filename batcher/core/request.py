"""The engine's unit of work: one sequence, its tokens, its KV blocks and its state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batcher.core.sampling import SamplingParams

if TYPE_CHECKING:
    from batcher.core.outputs import TokenLogprobs


class Priority(enum.IntEnum):
    """Lower value is served first."""

    INTERACTIVE = 0
    BATCH = 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    # NOTE: plain attributes set once per member, not properties: the engine reads them for
    # every row of every step.
    def __init__(self, value: str) -> None:
        self.finished: bool = value not in ("waiting", "running")
        self.finish_reason: str | None = value if self.finished else None


@dataclass(slots=True, eq=False)
class Request:
    """A sequence in the engine.

    `token_ids` is prompt + generated so far; `num_computed_tokens` of them have KV in the cache.
    A preempted request drops its blocks and sets `num_computed_tokens` back to 0 (recompute).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = "default"
    priority: int = Priority.INTERACTIVE
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: tuple[int, ...] = ()

    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first scheduling; -1 = not yet scheduled
    # Times (monotonic seconds) filled in by the engine.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Prompt logprobs: how many prompt tokens (after the first) have been scored, and the
    # entries not yet handed out. Kept across preemption, so a recompute neither repeats nor
    # loses one.
    num_prompt_scored: int = 0
    prompt_scores: list[TokenLogprobs] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def prompt_unscored(self) -> bool:
        """Asks for prompt logprobs and some prompt token still lacks its entry."""
        return (self.sampling.prompt_logprobs is not None
                and self.num_prompt_scored < len(self.prompt_token_ids) - 1)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
