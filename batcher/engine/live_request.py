"""One in-flight request as the engine tracks it between steps: its detokenizer, the times its
tokens came, its waits after a preemption, and the final event it ends with."""

from __future__ import annotations

from dataclasses import dataclass, field

from batcher.core.step_updates import RequestUpdate
from batcher.engine.detokenizer import IncrementalDetokenizer
from batcher.engine.events import EngineEvent
from batcher.core.request import Request, RequestStatus
from batcher.telemetry.timings import EngineTimes


@dataclass(slots=True)
class LiveRequest:
    """Engine-side bookkeeping for one in-flight request."""

    request: Request
    detok: IncrementalDetokenizer
    token_times: list[float] = field(default_factory=list)
    abort_time: float | None = None
    # Waiting again after a preemption: since when, and the waits so far (split at the first
    # token, so the latency anatomy can move them out of prefill or decode into queue).
    preempted_at: float | None = None
    requeue_before: float = 0.0
    requeue_after: float = 0.0

    def end_requeue(self, now: float) -> None:
        if self.preempted_at is None:
            return
        wait = max(0.0, now - self.preempted_at)
        if self.request.first_token_time is None:
            self.requeue_before += wait
        else:
            self.requeue_after += wait
        self.preempted_at = None

    def add_until_stop(self, u: RequestUpdate) -> str:
        """Several tokens from one step (speculation): detokenize them one at a time, so a stop
        string ends the output at the same token as plain decoding would; the tokens after it
        are dropped from the update and the request."""
        parts: list[str] = []
        for i, token in enumerate(u.new_token_ids):
            parts.append(self.detok.add([token]))
            extra = len(u.new_token_ids) - i - 1
            if self.detok.stopped and extra:
                del u.new_token_ids[-extra:], u.new_logprobs[-extra:]
                del self.token_times[-extra:], self.request.token_ids[-extra:]
                if u.status is RequestStatus.FINISHED_LENGTH:  # the stop came first
                    u.status = self.request.status = RequestStatus.FINISHED_STOPPED
                break
        return "".join(parts)

    def times(self, now: float) -> EngineTimes:
        """The request's marks as its final event carries them, were it to end at `now` (a
        wait after a preemption still under way counts to `now`)."""
        req = self.request
        before, after = self.requeue_before, self.requeue_after
        if self.preempted_at is not None:
            wait = max(0.0, now - self.preempted_at)
            if req.first_token_time is None:
                before += wait
            else:
                after += wait
        return EngineTimes(
            first_scheduled=req.first_scheduled_time, first_token=req.first_token_time,
            last_token=self.token_times[-1] if self.token_times else None, finished=now,
            requeue_before_first_token=before, requeue_after_first_token=after,
            preemptions=req.num_preemptions)

    def final_event(self, now: float, ev: EngineEvent | None = None,
                    error: str | None = None) -> EngineEvent:
        """`ev` (or a new event) completed as the request's last: why it finished, its counts
        and its timings."""
        req = self.request
        ev = ev or EngineEvent(req.request_id)
        ev.finish_reason = "error" if error else (req.status.finish_reason or "abort")
        ev.error = error
        ev.stop_reason = self.detok.stop_reason
        ev.num_prompt_tokens = req.num_prompt_tokens
        ev.num_output_tokens = req.num_output_tokens
        ev.num_cached_tokens = max(0, req.num_cached_tokens)
        if req.first_scheduled_time is not None:
            ev.queue_wait = req.first_scheduled_time - req.arrival_time
        if req.first_token_time is not None:
            ev.ttft = req.first_token_time - req.arrival_time
        ev.e2e = now - req.arrival_time
        ev.token_times = self.token_times
        ev.priority = int(req.priority)
        self.end_requeue(now)
        ev.times = self.times(now)
        return ev
