"""Where a step's results go: each live request's detokenizer and its stream, by request ID."""

from __future__ import annotations

import time
from typing import Any

from batcher.core.outputs import SchedulerOutput
from batcher.core.request import Request, RequestStatus
from batcher.core.request_registry import RequestRegistry
from batcher.core.scheduler import Scheduler
from batcher.core.step_updates import RequestUpdate
from batcher.engine.events import EngineEvent
from batcher.engine.live_request import LiveRequest


class StreamOutputs:
    """The engine's requests in flight (`live`), their streams, and the ones waiting again after
    a preemption. Runs on the event loop only.

    A request ID is free for a new request as soon as its request's final event is pushed, even
    while a step launched before that still holds a row of the old one (the engine's overlap):
    that step's results for the ID are dropped, because the request under it then is absent or
    not yet running (only `schedule` starts one), and the next schedule's report of the old
    request's freeing names the request itself (`SchedulerOutput.freed`), matched by identity.
    """

    def __init__(self, scheduler: Scheduler, metrics: Any = None) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.streams = RequestRegistry()
        self.live: dict[str, LiveRequest] = {}
        self.preempted: set[str] = set()  # waiting again after a preemption

    def note_freed(self, freed: list[Request], now: float) -> None:
        """Requests whose blocks were just released: the preempted wait again from now; the
        aborted ones end."""
        for req in freed:
            live = self.live.get(req.request_id)
            if live is None or live.request is not req:
                continue  # ended already; its ID may be a new request's now
            if not req.is_finished:
                live.preempted_at = now
                self.preempted.add(req.request_id)
                continue
            if req.status is not RequestStatus.FINISHED_ABORTED:
                # Ended by its last step's update: `emit` ends it with that step's tokens
                # (which, with the engine's overlap, comes after the next step is scheduled).
                continue
            if live.abort_time is not None and self.metrics is not None:
                self.metrics.observe_cancel_delay(now - live.abort_time)
            self.finish(live, now)

    def note_rescheduled(self, sched: SchedulerOutput, now: float) -> None:
        """Preempted requests that run again in this step: their wait ends now."""
        if not self.preempted:
            return
        ids = {s.request_id for s in sched.seqs}
        for rid in [r for r in self.preempted if r in ids]:
            self.preempted.discard(rid)
            live = self.live.get(rid)
            if live is not None:
                live.end_requeue(now)

    def cut(self, failed: dict[str, str]) -> list[tuple[LiveRequest, str]]:
        """Requests the runner cut (a grammar over its budget) end with that error
        before the step's update, so the token sampled for them is dropped: it cannot stop them
        first. Returns them with their errors, for `end_cut` once the step is emitted."""
        cut = []
        for rid, reason in failed.items():
            live = self.live.get(rid)
            # NOTE: the request that ran the row is still running: only `schedule` changes
            # that, and it runs after this. A request under its ID that is not running came in
            # after the row's request ended (a stop string) and is not the one cut.
            if live is None or live.request.status is not RequestStatus.RUNNING:
                continue
            self.scheduler.finish(rid, RequestStatus.FINISHED_ERROR)
            cut.append((live, reason))
        return cut

    def end_cut(self, cut: list[tuple[LiveRequest, str]], now: float) -> None:
        """The final events of the requests `cut` ended, with their errors."""
        for live, reason in cut:
            if self.live.get(live.request.request_id) is live:
                self.finish(live, now, error=reason)

    def emit(self, updates: list[RequestUpdate], now: float) -> None:
        """Detokenize a step's updates and push them to their streams; a stop string matched on
        text ends its request here."""
        # NOTE: readers are paced on the real clock, whatever clock the engine keeps: a stream
        # woken a moment ago takes this step's tokens with its next wake, merged into the event
        # it has not taken (`RequestRegistry.push`), so the loop wakes readers a bounded number
        # of times a second however fast steps come. The update's lists are its own: the event
        # takes them.
        wall = time.monotonic()
        lives = self.live
        push = self.streams.push
        for u in updates:
            live = lives.get(u.request_id)
            if live is None:
                continue  # output of a request the engine no longer tracks: drop it
            ids = u.new_token_ids
            if len(ids) == 1:
                live.token_times.append(now)
                text = live.detok.add(ids)
            else:
                live.token_times.extend([now] * len(ids))
                text = live.add_until_stop(u)
            detok = live.detok
            if detok.stopped and not u.status.finished:
                self.scheduler.finish(u.request_id, RequestStatus.FINISHED_STOPPED)
            ev = EngineEvent(u.request_id, text, ids, u.new_logprobs, u.prompt_logprobs)
            if live.request.status.finished:
                if not detok.stopped:
                    ev.text += detok.flush()
                self.finish(live, now, ev)
            elif len(live.token_times) == len(ids):  # the first tokens: never held
                push(u.request_id, ev, merge=True, now=wall)
            else:
                push(u.request_id, ev, merge=True, paced=True, now=wall)
        self.streams.release_held(wall)

    def finish(self, live: LiveRequest, now: float, ev: EngineEvent | None = None,
               error: str | None = None) -> None:
        """Push a request's final event and close its stream."""
        req = live.request
        rid = req.request_id
        ev = live.final_event(now, ev, error)
        self.preempted.discard(rid)
        del self.live[rid]
        self.streams.push(rid, ev, merge=True, now=time.monotonic())
        self.streams.close_stream(rid)
        if self.metrics is not None and not req.tenant.startswith("__"):
            self.metrics.observe_finished(ev)

    def fail_all(self, reason: str, now: float) -> None:
        """End every request in flight with an `error` event."""
        for rid, live in list(self.live.items()):
            if not live.request.is_finished:
                self.scheduler.finish(rid, RequestStatus.FINISHED_ERROR)
            self.finish(live, now, error=reason)
