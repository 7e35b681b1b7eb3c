"""One generation request's latency anatomy on the replica: the marks the handler sets, the
engine's times from the final events, the split into phases, the phase histograms and the
access line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from aiohttp import web

from batcher import tracing
from batcher.access_log import log_access
from batcher.metrics import Metrics, priority_label
from batcher.timings import PhaseClock, Timings, split

if TYPE_CHECKING:
    from batcher.engine_events import EngineEvent
    from batcher.server.gateway import Job


class RequestTiming:
    """Created when the handler starts (the request's headers are in; its body is not read)."""

    __slots__ = ("finish_reason", "job", "marks", "metrics", "request", "timings")

    def __init__(self, metrics: Metrics, request: web.Request) -> None:
        self.metrics = metrics
        self.request = request
        self.marks = PhaseClock()
        self.job: Job | None = None
        self.timings: Timings | None = None
        self.finish_reason: str | None = None

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

    def done(self, status: int, error_code: str | None = None) -> None:
        """The answer went out (or failed): histograms for served requests, the access line
        (with the error's code for a refusal or a failure: why, where an operator looks)."""
        ran = self.timings is not None
        t = self.timings or split(self.marks, None, self.marks.clock())
        prio = self.job.requests[0].priority if self.job and self.job.requests else 0
        if ran and status < 400:
            self.metrics.observe_phases(t, prio)
        tenant = getattr(self.request.get("tenant"), "name", "-")
        rid = self.request.get("request_id", "")
        log_access(request_id=rid, tenant=tenant, route=self.request.path, status=status,
                   timings=t, finish_reason=self.finish_reason, priority=priority_label(prio),
                   error_code=error_code)
        tracer = tracing.current()
        if tracer is not None:
            tracer.record("batcher.request", self.request.headers, t, {
                "batcher.request_id": rid, "batcher.tenant": tenant,
                "http.route": self.request.path, "http.status_code": status,
                "batcher.priority": priority_label(prio), "batcher.bottleneck": t.bottleneck,
                "batcher.prompt_tokens": t.prompt_tokens,
                "batcher.completion_tokens": t.completion_tokens})
