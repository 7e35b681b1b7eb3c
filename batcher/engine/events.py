"""What an engine hands its callers: one event per token delta, and the error it raises when it
cannot serve."""

from __future__ import annotations

from dataclasses import dataclass, field

from batcher.core.outputs import TokenLogprobs
from batcher.telemetry.timings import EngineTimes


class EngineError(RuntimeError):
    """The engine cannot serve: it failed (see `snapshot().error`) or is shutting down."""


@dataclass(slots=True)
class EngineEvent:
    """A text/token delta for one request; the last one has `finish_reason` set (and `error`
    when the reason is "error"), with the request's counts and timings."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # On the first token's event of a request that asked: one entry per prompt token after
    # the first.
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    stop_reason: str | None = None  # the stop string that matched
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    queue_wait: float | None = None
    ttft: float | None = None
    e2e: float | None = None
    token_times: list[float] = field(default_factory=list)  # monotonic time of each token
    priority: int = 0
    times: EngineTimes | None = None  # the request's engine-side marks, on the final event

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def absorb(self, later: EngineEvent) -> None:
        """Take in the request's next event, as if both had come as one: its text and tokens
        follow this event's, and a final event's counts and timings become this one's. A
        stream whose reader has not yet taken an event grows it instead of queueing another."""
        self.text += later.text
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        if later.finish_reason is not None:
            self.finish_reason = later.finish_reason
            self.error = later.error
            self.stop_reason = later.stop_reason
            self.num_prompt_tokens = later.num_prompt_tokens
            self.num_output_tokens = later.num_output_tokens
            self.num_cached_tokens = later.num_cached_tokens
            self.queue_wait = later.queue_wait
            self.ttft = later.ttft
            self.e2e = later.e2e
            self.token_times = later.token_times
            self.priority = later.priority
            self.times = later.times

    @property
    def tpot(self) -> float | None:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None
