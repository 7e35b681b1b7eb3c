"""AsyncEngine: the continuous-batching step loop behind an async API.

Scheduling and output demultiplexing run on the event loop; tensor work runs in one worker thread,
so the loop stays free for HTTP while a step (even a long prefill chunk) runs; a runner that
launches a step and reads its tokens back apart has them read on a second thread, so the worker
launches the next step while the device still runs this one. Each step is
launched before the previous step's tokens are detokenized and streamed (`_run`, by default;
`overlap=False`, `--no-step-overlap`: the other way round), so the model runs it while the loop
emits. Each request's events go to its own stream queue (by request ID); a consumer that goes
away aborts its request and its KV blocks are freed at the next step.
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
from batcher.engine.detokenizer import IncrementalDetokenizer
from batcher.engine.events import EngineError, EngineEvent
from batcher.engine.snapshot import EngineSnapshot, UnservedPrefill, scheduler_snapshot
from batcher.engine.stream_outputs import StreamOutputs
from batcher.engine.live_request import LiveRequest
from batcher.engine.model_steps import ModelSteps, StepResult
from batcher.core.request import Request
from batcher.core.request_registry import iter_stream
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

# With overlap, the loop waits up to this long for the model thread to take the step it just
# launched before it emits the last one (see `_run`).
HANDOFF_WAIT_S = 0.005

# Steps are scheduled ahead (`AsyncEngine._launch_ahead`) only while the model's step takes at
# most this long. What it saves is the loop's time between two steps (about half a millisecond
# on a 2-core CPU, a tenth to a third of that on a server's): a fifth of a 2 ms GPU step, under
# 5% of a 10 ms one. What it costs is a step of first-token time for a request arriving
# meanwhile (it waits for the queued step), a full step on a CPU (tens of milliseconds).
AHEAD_MAX_STEP_S = 0.010

# A step handed to the model thread: what was scheduled, when, its (output, model seconds, when
# the model thread finished it), and whether it was scheduled ahead (queued behind another).
_Step = tuple[SchedulerOutput, float, "asyncio.Future[StepResult]", bool]


class Runner(Protocol):
    """What the engine needs from a model runner (the real one, or the fake one for fleets).
    A runner may also split a step in two, `launch(sched, before) -> launched` on the model
    thread and `finish(launched) -> RunnerOutput` on the engine's reader thread (the real one
    does): `before` is the step launched just before a step scheduled ahead, whose tokens are
    that step's inputs."""

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
                 prefix_cache_scope: str = "tenant", overlap: bool = True):
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
        # Each live request's stream, by request ID: where a step's tokens go.
        self.outputs = StreamOutputs(self.scheduler, metrics)
        self._wake = asyncio.Event()
        # The model thread (and the reader thread of a runner that splits its steps).
        self.model_steps = ModelSteps(runner, clock)
        self._task: asyncio.Task[None] | None = None
        self._error: str | None = None
        self._stopping = False
        self.steps = 0
        self.last_step_end = clock()
        self.busy_since: float | None = None
        # Launch each step before emitting the previous one's tokens (see `_run`); off, the host
        # emits a step's tokens and only then schedules the next.
        self.overlap = overlap
        # In steady decoding, queue each next step before the last one's tokens are known
        # (`_launch_ahead`); with overlap only, and only while steps take at most
        # `ahead_max_step_s`: a request arriving meanwhile waits for the queued step, which
        # is worth it only where the loop's own time between steps is a sizeable share of one.
        self.ahead = overlap
        self.ahead_max_step_s = AHEAD_MAX_STEP_S
        self._last_step_s = float("inf")  # the model's time of the last step, once measured
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
        self._unsent_freed: list[str] = []  # freed in steps with no rows (only aborts)

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
        self.outputs.fail_all(reason, self.clock())
        self.model_steps.shutdown()
        # NOTE: the thread ends right after its last step; wait for that (off the event loop) so
        # the process can exit cleanly. A wedged step was already given its grace period.
        if not wedged:
            # An idle thread ends at once; one stuck in a call the loop stopped awaiting does not.
            await self.model_steps.join(1.0)

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
        queue = self.outputs.streams.create_stream(rid)
        try:
            if not request.eos_token_ids:
                request.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
            if request.sampling.prompt_logprobs is not None and not self.scores_prompts:
                raise ValueError("prompt logprobs are not supported by this model")
            self.scheduler.add_request(request)
        except BaseException:
            self.outputs.streams.discard(rid)
            raise
        self.outputs.live[rid] = LiveRequest(request, IncrementalDetokenizer(
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
            self.outputs.streams.discard(rid, queue)

    def abort(self, request_id: str) -> bool:
        """Abort from any task; the blocks are freed at the start of the next step."""
        live = self.outputs.live.get(request_id)
        if live is None or not self.scheduler.abort(request_id):
            return False
        live.abort_time = self.clock()
        self._wake.set()
        return True

    def times(self, request_id: str) -> EngineTimes | None:
        """The marks of a request still in flight, as if it ended now (None once it has
        ended): what a request cut short (a client gone, a shutdown) ran, for its access line
        and phase histograms."""
        live = self.outputs.live.get(request_id)
        return None if live is None else live.times(self.clock())

    def owns(self, request_id: str) -> bool:
        return request_id in self.outputs.live

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
        try:
            await self._steps()
        except Exception as exc:  # a bug on the host's side: fail everyone loudly, as below
            log.exception("the engine loop failed")
            self._error = f"engine loop failed: {type(exc).__name__}: {exc}"
            self.outputs.fail_all(self._error, self.clock())

    async def _steps(self) -> None:
        # NOTE: the next step is scheduled and handed to the model thread as soon as this step's
        # results are applied to the scheduler, before its tokens are detokenized and pushed to
        # their streams: the model runs step N+1 while the host emits step N (see `_launch`).
        # In steady decoding the step after that is queued too, before N+1's tokens are known
        # (`_launch_ahead`): the model starts it as N+1 ends, without waiting for this loop.
        loop = asyncio.get_running_loop()
        step: _Step | None = None
        queued: _Step | None = None  # scheduled ahead: behind `step` on the model thread
        while step is not None or not self._stopping:
            if step is None:
                if not self.scheduler.has_unfinished():
                    self.busy_since = None
                    if self.metrics is not None and self.phase == "serve":
                        self.metrics.observe_state(self.snapshot())  # idle: the gauges say so
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                step = self._launch(loop)
                if step is None:
                    await asyncio.sleep(0)  # only aborts were processed
                    continue
                queued = self._launch_ahead(loop, step[0])
            sched, started, running, ahead = step
            if running.done():
                # NOTE: a step queued ahead that ended before this loop got to it (a device
                # faster than the host): the streams just emitted to, and the requests
                # arriving, get their turn first, as they do while a step runs.
                await asyncio.sleep(0)
            try:
                out, model_seconds, ended = await running
            except Exception as exc:  # the model failed: fail everyone loudly, stop serving
                if queued is not None:
                    queued[2].cancel()
                log.exception("model step failed")
                self._error = f"model step failed: {type(exc).__name__}: {exc}"
                self.outputs.fail_all(self._error, self.clock())
                return
            self.steps += 1
            self._last_step_s = model_seconds
            self.last_step_end = now = self.clock()
            if ahead:  # it was queued behind the step before: it started as that one ended
                started = max(started, ended - model_seconds)
            learn = self._teaches(sched, started, model_seconds)
            cut = self.outputs.cut(out.failed) if out.failed else []
            updates = self.scheduler.update(sched, out)
            if learn is not None:  # before the next schedule: admission reads the queue left
                for listener in self.step_listeners:
                    listener(sched, now - started)
            step = None
            if queued is not None:  # already on the model thread
                step, queued = queued, None
            elif self.overlap and not self._stopping and self.scheduler.has_unfinished():
                step = self._launch(loop)
                if step is not None and updates:
                    # NOTE: the model thread needs the GIL to fill and launch its step, and
                    # emitting is pure Python that would hold it to the end (the interpreter's
                    # switch interval is longer than an emit): waiting here hands it over, so
                    # the step is queued first and runs while this thread emits.
                    self.model_steps.wait_under_way(HANDOFF_WAIT_S)
            self.outputs.emit(updates, now)
            self.outputs.end_cut(cut, now)
            if step is not None:
                # NOTE: after emitting, while `step` runs: a request a stop string ended just
                # now gets no row in it (a step launched before emitting holds its one
                # wasted row).
                queued = self._launch_ahead(loop, step[0])
                if queued is not None:
                    # NOTE: a model thread that only launches (the reader waits for the device)
                    # is free for it: the step is queued on the device now, not when this
                    # thread next lets go of the GIL (a switch interval later, with the host's
                    # work the longer part). One that still runs the step before is not waited
                    # for.
                    self.model_steps.wait_under_way(HANDOFF_WAIT_S)
            if learn is not None:
                # NOTE: after the next step's launch, while the device runs it: the filter's
                # update is a tenth of a millisecond of the host's time that no step waits
                # for. The step just launched was sized by the fit one step older.
                self.step_time_model.observe(learn, model_seconds)
            # Work waits from the moment the model finished: a pause of this loop while it
            # emits (a GC pause, a blocked handler) counts as a gap before the next step.
            self._work_pending_since = ended if self.scheduler.has_unfinished() else None
            if self.metrics is not None and self.phase == "serve":
                self.metrics.observe_step(self.scheduler.stats, len(sched.seqs))
                if now - self._gauges_at >= STATE_GAUGES_EVERY_S:  # idle: the branch above
                    self._gauges_at = now
                    self.metrics.observe_state(self.snapshot())
                self.metrics.observe_step_shape(sched, model_seconds)

    def _launch(self, loop: asyncio.AbstractEventLoop) -> _Step | None:
        """Schedule the next step and hand it to the model thread; None if it has no rows (only
        aborts were processed).

        A step launched before the previous step's tokens are emitted may hold a row of a
        request that emitting then ends (a stop string matched on text): the row's work is
        wasted and its token dropped (`Scheduler.update` skips finished requests). Its blocks
        are freed while the step writes them, which is safe (`Scheduler.schedule_ahead` says
        why): the model runs steps one after another, so the old row writes before any new
        owner of a block does. Those blocks are free for the step after next, one step later
        than without overlap.
        """
        return self._hand_over(loop, self.scheduler.schedule(), ahead=False)

    def _launch_ahead(self, loop: asyncio.AbstractEventLoop, prev: SchedulerOutput
                      ) -> _Step | None:
        """Queue the step after `prev` (launched, its tokens not yet known) on the model thread
        behind it, if the scheduler can tell it now (`Scheduler.schedule_ahead`: steady
        decoding). The model thread fills in each row's input from `prev`'s output."""
        if (not (self.ahead and self.overlap) or self._stopping
                or self._last_step_s > self.ahead_max_step_s):
            return None
        sched = self.scheduler.schedule_ahead(prev)
        return None if sched is None else self._hand_over(loop, sched, ahead=True)

    def _hand_over(self, loop: asyncio.AbstractEventLoop, sched: SchedulerOutput,
                   ahead: bool) -> _Step | None:
        """Note what the step freed (aborted requests end here) and queue it on the model
        thread with the freed IDs not yet told; None if it has no rows."""
        self.outputs.note_freed(sched.freed, self.clock())
        if sched.is_empty:
            # The runner drops a freed request's state (grammar, staged prompt) when told: tell
            # it with the next step it runs.
            self._unsent_freed += sched.freed_ids
            return None
        if self._unsent_freed:
            sched.freed_ids[:0] = self._unsent_freed
            self._unsent_freed = []
        if self.busy_since is None:
            self.busy_since = self.clock()
        started = self.clock()
        self.outputs.note_rescheduled(sched, started)
        return sched, started, self.model_steps.run(loop, sched), ahead

    @property
    def stall_log(self) -> StallLog:
        return self.stalls.log

    def _teaches(self, sched: SchedulerOutput, started: float, seconds: float
                 ) -> StepShape | None:
        """The step's shape, for the step-time model and the step's listeners to learn from;
        None when it taught nothing: a warm-up step, or one held up by a stall (noted in
        `stalls` for admission)."""
        shape = StepShape.of(sched, self.kv.block_size)
        pending = self._work_pending_since
        gap = started - pending if pending is not None else 0.0
        predicted = self.step_time_model.predict(shape) if self.step_time_model.num_observations \
            else 0.0
        stalled = self.stalls.step(started, seconds, predicted, gap)
        if self.phase == "warm" or stalled:
            return None
        return shape
