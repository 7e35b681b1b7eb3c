"""AsyncEngine: the continuous-batching step loop behind an async API.

Scheduling and output demultiplexing run on the event loop; tensor work runs in one worker thread,
so the loop stays free for HTTP while a step (even a long prefill chunk) runs. Each request's
events go to its own stream queue (by request ID); a consumer that goes away aborts its request
and its KV blocks are freed at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from batcher.core.backlog import Backlog
from batcher.core.config import CacheConfig, SchedulerConfig
from batcher.core.kv_cache_manager import KVCacheManager
from batcher.core.outputs import RunnerOutput, SchedulerOutput
from batcher.core.scheduler import Scheduler
from batcher.core.stalls import StallDetector, StallLog
from batcher.core.step_time import OnlineStepTimeModel, StepShape
from batcher.core.step_updates import RequestUpdate
from batcher.engine.detokenizer import IncrementalDetokenizer
from batcher.engine.events import EngineError, EngineEvent
from batcher.engine.snapshot import EngineSnapshot, UnservedPrefill, scheduler_snapshot
from batcher.engine.live_request import LiveRequest
from batcher.engine.model_thread import ModelThread
from batcher.core.request import Request, RequestStatus
from batcher.core.request_registry import RequestRegistry, iter_stream
from batcher.core.sampling import SamplingParams
from batcher.telemetry.timings import EngineTimes
from batcher.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Work is pending but no step finished for this long: the engine is wedged.
STALL_SECONDS = 30.0
PROBE_PRIORITY = -1  # ahead of every client class
# The metrics' state gauges (KV in use, running, waiting, ...) are refreshed at most this often
# while the engine is busy, and always when it goes idle; counters and histograms take every step.
STATE_GAUGES_EVERY_S = 0.05
# On stop, a step still running after this long is abandoned (a wedged model must not keep the
# process from exiting); its requests get an error event like every other in-flight one.
STOP_GRACE_SECONDS = 5.0


class Runner(Protocol):
    """What the engine needs from a model runner (the real one, or the fake one for fleets)."""

    num_blocks: int
    block_size: int

    def execute(self, sched: SchedulerOutput) -> RunnerOutput: ...


class AsyncEngine:
    """`async for ev in engine.generate(req, stop=[...])`; `engine.abort(id)`;
    `engine.snapshot()`."""

    def __init__(self, runner: Runner, tokenizer: Tokenizer,
                 sched_config: SchedulerConfig | None = None, enable_prefix_caching: bool = True,
                 metrics: Any = None, version: str = "v1",
                 clock: Callable[[], float] = time.monotonic, debug_checks: bool = False,
                 step_time_model: OnlineStepTimeModel | None = None,
                 prefix_cache_scope: str = "tenant"):
        self.runner = runner
        self.tokenizer = tokenizer
        # Grammar-constrained rows need a runner that masks tokens (the fake one does not).
        attach = getattr(runner, "attach_tokenizer", None)
        self.supports_grammar = attach is not None
        if attach is not None:
            attach(tokenizer)
        # Prompt logprobs need a runner that scores prompt rows (the fake one does not).
        self.scores_prompts = bool(getattr(runner, "scores_prompts", False))
        self.kv = KVCacheManager(runner.num_blocks, runner.block_size, enable_prefix_caching,
                                 prefix_cache_scope, getattr(runner, "kv_window", None))
        # Fed every step's measured model time; read by the scheduler's step budget and admission.
        self.step_time_model = step_time_model or OnlineStepTimeModel()
        self.scheduler = Scheduler(sched_config or SchedulerConfig(), self.kv, clock=clock,
                                   debug_checks=debug_checks, step_time=self.step_time_model)
        self.metrics = metrics
        self.version = version
        self.clock = clock
        self._streams = RequestRegistry()
        self._live: dict[str, LiveRequest] = {}
        self._preempted: set[str] = set()  # waiting again after a preemption
        self._wake = asyncio.Event()
        self._executor = ModelThread("batcher-model")
        self._task: asyncio.Task[None] | None = None
        self._error: str | None = None
        self._stopping = False
        self.steps = 0
        self.last_step_end = clock()
        self.busy_since: float | None = None
        # Called after every step with (scheduler output, step seconds): admission's rate EWMAs.
        self.step_listeners: list[Callable[[SchedulerOutput, float], None]] = []
        # "warm": steps teach nothing (first runs compile); "calibrate": they teach the
        # step-time model and the listeners but are not served traffic (no metrics);
        # "serve": everything. See `batcher.engine.warmup`.
        self.phase = "serve"
        # Steps held up by something besides their work (a compile, a pause of the process):
        # they teach nothing, and admission discounts them from first tokens.
        self.stalls = StallDetector()
        self._work_pending_since: float | None = None
        # What the warm start did and measured (`batcher.engine.warmup.WarmStart.to_json`), if any.
        self.warm_start: dict[str, Any] | None = None
        self._gauges_at = float("-inf")  # when the metrics' state gauges were last refreshed
        self._unserved = UnservedPrefill()

    @classmethod
    def from_loaded(cls, loaded: Any, tokenizer: Tokenizer, sched_config: SchedulerConfig,
                    cache_config: CacheConfig, attention_backend: str = "auto",
                    cuda_graphs: bool = True, compile_decode: bool = False,
                    **kw: Any) -> AsyncEngine:
        """Build the real model runner for a loaded model, sizing the KV pool from the budget."""
        from batcher.runtime.kv_cache import default_kv_budget
        from batcher.runtime.model_runner import ModelRunner

        cache_config.validate()
        per_token = loaded.config.kv_bytes_per_token(loaded.dtype)
        num_blocks = cache_config.resolve_num_blocks(per_token, default_kv_budget(loaded.device))
        runner = ModelRunner(loaded, num_blocks, cache_config.block_size,
                             attention_backend=attention_backend, cuda_graphs=cuda_graphs,
                             compile_decode=compile_decode,
                             max_graph_batch=sched_config.max_num_seqs,
                             max_graph_tokens=sched_config.max_num_batched_tokens,
                             max_model_len=sched_config.max_model_len)
        return cls(runner, tokenizer, sched_config,
                   enable_prefix_caching=cache_config.enable_prefix_caching,
                   prefix_cache_scope=cache_config.prefix_cache_scope, **kw)

    # lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def stop(self, reason: str = "the server is shutting down") -> None:
        """Stop stepping; every request still in flight gets an `error` event."""
        self._stopping = True
        self._wake.set()
        wedged = False
        if self._task is not None:
            # The loop exits after its current step; a step that does not return in time (a
            # wedged model) is abandoned: the task is cancelled, its thread left behind.
            done, _ = await asyncio.wait({self._task}, timeout=STOP_GRACE_SECONDS)
            if not done:
                log.error("a model step did not finish within %.0fs of stop; abandoning it",
                          STOP_GRACE_SECONDS)
                wedged = True
                self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._fail_all(reason)
        self._executor.shutdown(wait=False, cancel_futures=True)
        # NOTE: the thread ends right after its last step; wait for that (off the event loop) so
        # the process can exit cleanly. A wedged step was already given its grace period.
        if not wedged:
            # An idle thread ends at once; one stuck in a call the loop stopped awaiting does not.
            await asyncio.get_running_loop().run_in_executor(None, self._executor.join, 1.0)

    @property
    def healthy(self) -> bool:
        return self._error is None and not self._stopping

    @property
    def stopping(self) -> bool:
        """`stop()` was called: requests that end now end for a shutdown, not a failure."""
        return self._stopping

    # requests ------------------------------------------------------------------------------
    async def generate(self, request: Request, stop: list[str] | None = None
                       ) -> AsyncIterator[EngineEvent]:
        """Queue `request` and yield its events until the final one. Raises ValueError for a
        request that can never run, `DuplicateRequestId` for an ID already in flight, and
        EngineError when the engine cannot serve. Leaving early (break, cancel, disconnect)
        aborts the request. The step loop starts on first use, so a caller that never called
        `start()` gets an answer, not a request that waits forever."""
        if not self.healthy:
            raise EngineError(self._error or "the engine is stopping")
        if self._task is None:
            await self.start()
        rid = request.request_id
        queue = self._streams.create_stream(rid)
        try:
            if not request.eos_token_ids:
                request.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
            if request.sampling.prompt_logprobs is not None and not self.scores_prompts:
                raise ValueError("prompt logprobs are not supported by this model")
            self.scheduler.add_request(request)
        except BaseException:
            self._streams.discard(rid)
            raise
        self._live[rid] = LiveRequest(request, IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, stop or request.sampling.stop))
        self._wake.set()
        finished = False
        try:
            async for ev in iter_stream(queue):
                finished = ev.finished
                yield ev
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)
            self._streams.discard(rid, queue)

    def abort(self, request_id: str) -> bool:
        """Abort from any task; the blocks are freed at the start of the next step."""
        live = self._live.get(request_id)
        if live is None or not self.scheduler.abort(request_id):
            return False
        live.abort_time = self.clock()
        self._wake.set()
        return True

    def times(self, request_id: str) -> EngineTimes | None:
        """The marks of a request still in flight, as if it ended now (None once it has
        ended): what a request cut short (a client gone, a shutdown) ran, for its access line
        and phase histograms."""
        live = self._live.get(request_id)
        return None if live is None else live.times(self.clock())

    def owns(self, request_id: str) -> bool:
        return request_id in self._live

    def backlog(self) -> Backlog:
        """The unserved work admission predicts a new request's wait from."""
        return Backlog.of_scheduler(self.scheduler)

    async def probe(self, timeout: float = 5.0) -> float:
        """One-token generation ahead of the queue; returns its latency (s). Raises on failure."""
        start = self.clock()
        bos = self.tokenizer.bos_token_id
        req = Request(f"probe-{time.time_ns()}", [bos if bos is not None else 0],
                      SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                      tenant="__probe__", priority=PROBE_PRIORITY)
        async with asyncio.timeout(timeout):
            async for ev in self.generate(req):
                if ev.finish_reason == "error":
                    raise EngineError(ev.error or "probe failed")
        return self.clock() - start

    def settings(self) -> dict[str, Any]:
        """The engine's effective configuration (the admin listener's `/admin/config`)."""
        cfg = self.scheduler.config
        return {"max_num_seqs": cfg.max_num_seqs,
                "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "max_model_len": cfg.max_model_len, "block_size": self.kv.block_size,
                "num_blocks": self.kv.num_total_blocks,
                "prefix_caching": self.kv.enable_prefix_caching,
                "prefix_cache_scope": self.kv.prefix_cache_scope,
                "warm_start": self.warm_start}

    def snapshot(self, *, draining: bool = False, in_flight: int = 0) -> EngineSnapshot:
        """Capacity and health now (the `/v1/state` contract); the gateway supplies what only
        it knows: whether it is draining and how many client requests it holds."""
        now = self.clock()
        stalled = self.busy_since is not None and now - self.last_step_end > STALL_SECONDS
        return scheduler_snapshot(
            self.scheduler, self.kv, version=self.version, draining=draining,
            healthy=self.healthy and not stalled, in_flight=in_flight,
            error=self._error or ("engine loop stalled" if stalled else None),
            steps=self.steps, last_step_age=now - self.last_step_end, unserved=self._unserved)

    # the loop ------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            if not self.scheduler.has_unfinished():
                self.busy_since = None
                if self.metrics is not None and self.phase == "serve":
                    self.metrics.observe_state(self.snapshot())  # idle: the gauges say so
                self._wake.clear()
                await self._wake.wait()
                continue
            sched = self.scheduler.schedule()
            self._note_freed(sched.freed_ids)
            if sched.is_empty:
                await asyncio.sleep(0)  # only aborts were processed
                continue
            if self.busy_since is None:
                self.busy_since = self.clock()
            started = self.clock()
            if self._preempted:
                self._note_rescheduled(sched, started)
            try:
                out, model_seconds = await loop.run_in_executor(
                    self._executor, self._timed_execute, sched)
            except Exception as exc:  # the model failed: fail everyone loudly, stop serving
                log.exception("model step failed")
                self._error = f"model step failed: {type(exc).__name__}: {exc}"
                self._fail_all(self._error)
                return
            self.steps += 1
            self.last_step_end = now = self.clock()
            learn = self._learns_from(sched, started, model_seconds)
            # Requests the runner cut (a grammar over its budget) end with that error, and the
            # token sampled for them this step is dropped: it cannot stop them normally first.
            for rid in out.failed:
                live = self._live.get(rid)
                if live is not None and not live.request.is_finished:
                    self.scheduler.finish(rid, RequestStatus.FINISHED_ERROR)
            updates = self.scheduler.update(sched, out)
            self._emit(updates, now)
            for rid, reason in out.failed.items():
                live = self._live.get(rid)
                if live is not None:
                    self._finish(live, now, error=reason)
            self._work_pending_since = now if self.scheduler.has_unfinished() else None
            if self.metrics is not None and self.phase == "serve":
                self.metrics.observe_step(self.scheduler.stats, len(sched.seqs))
                if now - self._gauges_at >= STATE_GAUGES_EVERY_S:  # idle: the branch above
                    self._gauges_at = now
                    self.metrics.observe_state(self.snapshot())
                self.metrics.observe_step_shape(sched, model_seconds)
            if learn:
                for listener in self.step_listeners:
                    listener(sched, now - started)

    @property
    def stall_log(self) -> StallLog:
        return self.stalls.log

    def _learns_from(self, sched: SchedulerOutput, started: float, seconds: float) -> bool:
        """Feed the step-time model this step unless it taught nothing: a warm-up step, or one
        held up by a stall (noted in `stalls` for admission). Returns whether the step's
        listeners learn from it too."""
        shape = StepShape.of(sched, self.kv.block_size)
        pending = self._work_pending_since
        gap = started - pending if pending is not None else 0.0
        predicted = self.step_time_model.predict(shape) if self.step_time_model.num_observations \
            else 0.0
        stalled = self.stalls.step(started, seconds, predicted, gap)
        if self.phase == "warm" or stalled:
            return False
        self.step_time_model.observe(shape, seconds)
        return True

    def _timed_execute(self, sched: SchedulerOutput) -> tuple[RunnerOutput, float]:
        """Run a step on the model thread and time it there: the model's own time, without the
        event loop's delay in noticing that it finished."""
        started = self.clock()
        out = self.runner.execute(sched)
        return out, self.clock() - started

    def _note_freed(self, freed_ids: list[str]) -> None:
        """Requests whose blocks were just released; finish the aborted ones."""
        now = self.clock()
        for rid in freed_ids:
            live = self._live.get(rid)
            if live is None:
                continue
            if not live.request.is_finished:  # preempted: waiting again from now
                live.preempted_at = now
                self._preempted.add(rid)
                continue
            if live.abort_time is not None and self.metrics is not None:
                self.metrics.observe_cancel_delay(now - live.abort_time)
            self._finish(live, now)

    def _note_rescheduled(self, sched: SchedulerOutput, now: float) -> None:
        """Preempted requests that run again in this step: their wait ends now."""
        ids = {s.request_id for s in sched.seqs}
        for rid in [r for r in self._preempted if r in ids]:
            self._preempted.discard(rid)
            live = self._live.get(rid)
            if live is not None:
                live.end_requeue(now)

    def _emit(self, updates: list[RequestUpdate], now: float) -> None:
        # NOTE: readers are paced on the real clock, whatever clock the engine keeps: a stream
        # woken a moment ago takes this step's tokens with its next wake, merged into the event
        # it has not taken (`RequestRegistry.push`), so the loop wakes readers a bounded number
        # of times a second however fast steps come. The update's lists are its own: the event
        # takes them.
        wall = time.monotonic()
        lives = self._live
        push = self._streams.push
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
                self._finish(live, now, ev)
            elif len(live.token_times) == len(ids):  # the first tokens: never held
                push(u.request_id, ev, merge=True, now=wall)
            else:
                push(u.request_id, ev, merge=True, paced=True, now=wall)
        self._streams.release_held(wall)

    def _finish(self, live: LiveRequest, now: float, ev: EngineEvent | None = None,
                error: str | None = None) -> None:
        req = live.request
        rid = req.request_id
        ev = live.final_event(now, ev, error)
        self._preempted.discard(rid)
        del self._live[rid]
        self._streams.push(rid, ev, merge=True, now=time.monotonic())
        self._streams.close_stream(rid)
        if self.metrics is not None and not req.tenant.startswith("__"):
            self.metrics.observe_finished(ev)

    def _fail_all(self, reason: str) -> None:
        now = self.clock()
        for rid, live in list(self._live.items()):
            if not live.request.is_finished:
                self.scheduler.finish(rid, RequestStatus.FINISHED_ERROR)
            self._finish(live, now, error=reason)
