"""One generation request's latency anatomy on the replica: the marks the handler sets, the
engine's times from the final events, the split into phases, the phase histograms and the
access line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from aiohttp import web

from batcher.http.middleware import OTHER_ROUTE, matched_route
from batcher.telemetry import tracing
from batcher.telemetry.access_log import LOGGED, log_access
from batcher.engine.metrics import Metrics, priority_label
from batcher.telemetry.timings import EngineTimes, PhaseClock, Timings, split

if TYPE_CHECKING:
    from batcher.engine.engine import AsyncEngine
    from batcher.engine.events import EngineEvent
    from batcher.server.gateway import Job


# How a request ended, on its access line: answered whole (`done`), cut by the client going
# away, cut by the server shutting down, past its own deadline, failed after it was admitted
# (`error`), or refused before it ran (`refused`: a bad request, a key, admission).
OUTCOMES = ("done", "client_disconnect", "shutdown", "deadline", "error", "refused")


class RequestTiming:
    """Created when the handler starts (the request's headers are in; its body is not read)."""

    __slots__ = ("copies", "engine", "finish_reason", "job", "marks", "metrics", "outcome",
                 "request", "timings")

    def __init__(self, metrics: Metrics, request: web.Request,
                 engine: AsyncEngine | None = None) -> None:
        self.metrics = metrics
        self.request = request
        self.engine = engine  # to read the marks of a request cut short
        self.marks = PhaseClock()
        self.job: Job | None = None
        self.copies = 1  # choices per prompt (`n`): a prompt's tokens count once
        self.timings: Timings | None = None
        self.finish_reason: str | None = None
        self.outcome: str | None = None

    def finish(self, finals: Sequence[EngineEvent | None], usage: dict[str, Any]) -> Timings:
        """The phases now, with the engine's times of the choice that ended last (the one that
        set the total) and the answer's token counts."""
        done = [ev for ev in finals if ev is not None and ev.times is not None]
        last = max(done, key=lambda ev: ev.times.last_token or ev.times.finished or 0.0,
                   default=None) if done else None
        t = split(self.marks, last.times if last is not None else None, self.marks.clock())
        t.prompt_tokens = int(usage.get("prompt_tokens", 0))
        t.completion_tokens = int(usage.get("completion_tokens", 0))
        t.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        t.preemptions = sum(ev.times.preemptions for ev in done)  # type: ignore[union-attr]
        if last is not None:
            self.finish_reason = last.finish_reason
        self.timings = t
        return t

    def cut(self, outcome: str, finals: Sequence[EngineEvent | None] = ()) -> None:
        """The request ends before its answer is whole (`outcome` says how): its phases and
        tokens are what ran until now. Each choice's marks come from its final event when it
        has one, else from the engine while the choice is still in flight (call this before
        the choices are aborted), else from the request itself. Once the phases are known
        (`finish` ran before the cut), only the outcome changes."""
        assert outcome in OUTCOMES, outcome
        self.outcome = outcome
        if self.timings is not None or self.job is None:
            return
        now = self.marks.clock()
        times: list[EngineTimes] = []
        prompt = completion = cached = 0
        for i, req in enumerate(self.job.requests):
            ev = finals[i] if i < len(finals) else None
            got = ev.times if ev is not None else None
            if got is None and self.engine is not None:
                got = self.engine.times(req.request_id)
            if got is None:  # ended already: the request keeps its own marks
                got = EngineTimes(first_scheduled=req.first_scheduled_time,
                                  first_token=req.first_token_time,
                                  last_token=req.finished_time if req.first_token_time else None,
                                  finished=req.finished_time, preemptions=req.num_preemptions)
            times.append(got)
            completion += ev.num_output_tokens if ev is not None else req.num_output_tokens
            if i % self.copies == 0:
                prompt += req.num_prompt_tokens
                cached += max(0, req.num_cached_tokens)
            if ev is not None and ev.finish_reason is not None:
                self.finish_reason = ev.finish_reason
        # The choice that got furthest sets the phases, as the last to end does in `finish`.
        furthest = max(times, key=lambda m: m.last_token or m.first_token or m.first_scheduled
                       or 0.0, default=None)
        t = split(self.marks, furthest, now)
        t.prompt_tokens, t.completion_tokens, t.cached_tokens = prompt, completion, cached
        t.preemptions = sum(m.preemptions for m in times)
        self.timings = t

    def done(self, status: int, error_code: str | None = None) -> None:
        """The answer went out (or failed): the access line with how the request ended (and
        the error's code for a refusal or a failure: why, where an operator looks), and the
        phase histograms for every request that was admitted, however it ended."""
        if self.outcome is None:
            # A 4xx, or a 429/503 before admission, refused the request; a 5xx after, failed it.
            self.outcome = ("done" if status < 400 else "deadline" if status == 504
                            else "refused" if status < 500 or (self.job is None
                                                               and status != 500)
                            else "error")
        if self.timings is None and self.job is not None:
            self.cut(self.outcome)
        t = self.timings or split(self.marks, None, self.marks.clock())
        prio = self.job.requests[0].priority if self.job and self.job.requests else 0
        if self.job is not None:
            self.metrics.observe_phases(t, prio, matched_route(self.request) or OTHER_ROUTE)
        tenant = getattr(self.request.get("tenant"), "name", "-")
        rid = self.request.get("request_id", "")
        self.request[LOGGED] = True
        log_access(request_id=rid, tenant=tenant, route=self.request.path, status=status,
                   timings=t, finish_reason=self.finish_reason, priority=priority_label(prio),
                   error_code=error_code, outcome=self.outcome)
        tracer = tracing.current()
        if tracer is not None:
            tracer.record("batcher.request", self.request.headers, t, {
                "batcher.request_id": rid, "batcher.tenant": tenant,
                "http.route": self.request.path, "http.status_code": status,
                "batcher.priority": priority_label(prio), "batcher.bottleneck": t.bottleneck,
                "batcher.outcome": self.outcome,
                "batcher.prompt_tokens": t.prompt_tokens,
                "batcher.completion_tokens": t.completion_tokens})
