"""One simulated replica: the real `core/` Scheduler and KVCacheManager on a simulated clock.

Only the model is simulated: a step lasts what the step-time model says for its composition, and
each sampled row gets a synthetic token (never an EOS; requests run to `max_tokens`, as with
`ignore_eos`). Everything else (admission order, chunked prefill and its per-step budget from an
online step-time model fed with each step's time, block allocation, prefix hits, preemption by
recompute) is the production code's own behaviour.

The replica does not own an event loop. Its driver (the fleet simulator, or `run_alone` for one
replica) calls `start_step(now)`, which schedules a step and returns when it ends (or None when
there is nothing to do), then `finish_step(now)` at that time, which applies the step and returns
the requests that finished. Per request it keeps only first/last token times and a count, so a
fleet of millions of tokens stays small in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batcher.admission.admission import Admission, Ticket
from batcher.admission.feed import decode_step_fn, prefill_step_fn, step_observer
from batcher.core.backlog import Backlog
from batcher.core.config import SchedulerConfig
from batcher.core.kv_cache_manager import KVCacheManager
from batcher.core.outputs import RunnerOutput, SchedulerOutput
from batcher.core.scheduler import Scheduler
from batcher.core.step_time import CPU_PRIOR, OnlineStepTimeModel, StepShape
from batcher.core.request import Priority, Request, RequestStatus
from batcher.sim.stepmodel import LinearStepModel, StepModel
from batcher.admission.tenants import DEFAULT_TENANT

SYNTHETIC_TOKEN = 7  # any id works: the simulator never stops on EOS


@dataclass(slots=True)
class Timing:
    """A request's life on one replica (simulated seconds)."""

    request_id: str
    arrival: float
    prompt_tokens: int
    max_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    finished: float | None = None
    status: str = "running"
    owner: object = None  # the driver's record of the client request

    @property
    def tpot(self) -> float | None:
        if self.tokens < 2 or self.first_token is None or self.last_token is None:
            return None
        return (self.last_token - self.first_token) / (self.tokens - 1)


class SimReplica:
    """A replica's scheduler and block pool, stepped by a driver on a simulated clock.

    Contract: `add(request, timing, now)` queues a request (ValueError if it can never fit);
    `start_step(now)` -> end time or None (idle); `finish_step(now)` -> finished timings, to be
    called exactly at the returned end time. `fail(now)` drops every request (a crash).
    """

    def __init__(self, index: int, sched_config: SchedulerConfig, num_blocks: int,
                 block_size: int, step_model: StepModel, zone: int = 0,
                 prefix_caching: bool = True, debug_checks: bool = False) -> None:
        self.index = index
        self.replica_id = f"r{index}"
        self.zone = zone
        self.now = 0.0
        self.kv = KVCacheManager(num_blocks, block_size, prefix_caching)
        # The engine's own online model, fed the simulated step times, so chunk budgets follow
        # the simulated machine as they follow a real one. It starts from the calibrated fit.
        prior = step_model.prior() if isinstance(step_model, LinearStepModel) else CPU_PRIOR
        self.step_time_model = OnlineStepTimeModel(prior)
        self.scheduler = Scheduler(sched_config, self.kv, clock=self._clock,
                                   debug_checks=debug_checks, step_time=self.step_time_model)
        self.step_model = step_model
        self.timings: dict[str, Timing] = {}
        self.busy = False
        self.alive = True
        self.steps = 0
        self.busy_seconds = 0.0
        self._pending: SchedulerOutput | None = None
        self.on_token: Callable[[Timing, float], None] | None = None
        # The server's own admission control, when the driver turns it on (`use_admission`).
        self.admission: Admission | None = None
        self._tickets: dict[str, Ticket] = {}
        self._observe_step: Callable[[SchedulerOutput, float], None] | None = None
        self._step_started = 0.0

    def _clock(self) -> float:
        return self.now

    # the state a heartbeat reports (the `/v1/state` names) ---------------------------------
    @property
    def free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def total_blocks(self) -> int:
        return self.kv.num_total_blocks

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def unserved_prefill_tokens(self) -> int:
        """Prompt tokens accepted but not yet run through the model (`EngineSnapshot`'s)."""
        s = self.scheduler
        return (sum(r.num_tokens - r.num_computed_tokens for r in s.waiting)
                + sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in s.running))

    @property
    def fresh(self) -> bool:
        return self.alive

    @property
    def age(self) -> float:
        return 0.0

    def fits(self, prompt_tokens: int, max_tokens: int, max_waiting: int) -> bool:
        """The replica's final fit check: a bounded queue, and the request's whole KV need
        (prompt + output) within the free blocks left after the queued prompts."""
        if self.waiting >= max_waiting:
            return False
        queued = sum(self.kv.blocks_needed(r.num_tokens) for r in self.scheduler.waiting)
        need = self.kv.blocks_needed(prompt_tokens + max_tokens)
        return need <= self.kv.num_free_blocks - queued or (self.running == 0 and not queued)

    # driving --------------------------------------------------------------------------------
    def add(self, request: Request, timing: Timing, now: float) -> None:
        self.now = now
        request.arrival_time = now
        self.scheduler.add_request(request)
        self.timings[request.request_id] = timing

    def use_admission(self, **config: object) -> Admission:
        """Admit through `Admission(**config)` on this replica's clock, fed this replica's steps
        and first tokens as `batcher serve` feeds it; `offer` then refuses as the server would."""
        model, cfg = self.step_time_model, self.scheduler.config
        decode_step = decode_step_fn(model, cfg.min_prefill_chunk)
        config.setdefault("decode_step_s", decode_step)
        config.setdefault("prefill_step", prefill_step_fn(self.scheduler, model))
        self.admission = Admission(None, clock=self._clock, **config)  # type: ignore[arg-type]
        self._observe_step = step_observer(self.admission, self.scheduler, model, decode_step)
        return self.admission

    def offer(self, request: Request, timing: Timing, now: float) -> Ticket | None:
        """`add` through the replica's admission control, if any, returning its ticket: raises
        `Rejected` (the server's 503 with its retry_after) when the server would refuse."""
        ticket = None
        if self.admission is not None:
            self.now = now
            prio = "batch" if request.priority == Priority.BATCH else "interactive"
            ticket = self.admission.admit(
                DEFAULT_TENANT, prio, request.num_prompt_tokens, request.sampling.max_tokens,
                Backlog.of_scheduler(self.scheduler))
            self._tickets[request.request_id] = ticket
        self.add(request, timing, now)
        return ticket

    def start_step(self, now: float) -> float | None:
        """Schedule one step; the time it ends, or None when there is no work."""
        assert not self.busy and self.alive
        self.now = now
        if not self.scheduler.has_unfinished():
            return None
        sched = self.scheduler.schedule()
        if sched.is_empty:
            # NOTE: a step that only processed aborts, or preempted every running request,
            # schedules nothing; the next call admits from the queue.
            sched = self.scheduler.schedule()
            if sched.is_empty:
                return None
        self._pending = sched
        self.busy = True
        self._step_started = now
        dt = self.step_model.step_seconds(sched)
        self.step_time_model.observe(StepShape.of(sched, self.kv.block_size), dt)
        self.busy_seconds += dt
        return now + dt

    def finish_step(self, now: float) -> list[Timing]:
        """Apply the pending step at `now`; the timings of requests that finished in it."""
        sched = self._pending
        assert self.busy and sched is not None
        self.now = now
        self.busy = False
        self._pending = None
        self.steps += 1
        ids = [s.request_id for s in sched.seqs if s.sample]
        out = RunnerOutput(ids, [SYNTHETIC_TOKEN] * len(ids), [])
        done: list[Timing] = []
        for u in self.scheduler.update(sched, out):
            t = self.timings[u.request_id]
            if t.first_token is None:
                t.first_token = now
                if u.request_id in self._tickets and self.admission is not None:
                    self.admission.observe_first_token(self._tickets[u.request_id])
            t.last_token = now
            t.tokens += 1
            if self.on_token is not None:
                self.on_token(t, now)
            if u.finished:
                t.finished = now
                t.status = u.status.value
                del self.timings[u.request_id]
                self._release(u.request_id, t.tokens)
                done.append(t)
        if self._observe_step is not None:
            self._observe_step(sched, now - self._step_started)
        return done

    def _release(self, request_id: str, tokens: int) -> None:
        ticket = self._tickets.pop(request_id, None)
        if ticket is not None and self.admission is not None:
            self.admission.release(ticket, tokens)

    def fail(self, now: float) -> list[Timing]:
        """A crash: every request on the replica is lost; their timings are returned (the driver
        decides on retries). The replica is dead until `restart`."""
        self.now = now
        lost = list(self.timings.values())
        for t in lost:
            self.scheduler.finish(t.request_id, RequestStatus.FINISHED_ERROR)
            t.status = "error"
            self._release(t.request_id, t.tokens)
        self.timings.clear()
        self.alive = False
        self.busy = False
        self._pending = None
        return lost

    def restart(self, now: float) -> None:
        self.now = now
        self.alive = True


def run_alone(replica: SimReplica, arrivals: list[tuple[float, Request]]) -> list[Timing]:
    """Drive one replica through requests arriving at the given times (sorted by time) and
    return every request's timing, in finish order. Used by validation and tests."""
    pending = sorted(arrivals, key=lambda x: x[0])
    i = 0
    now = 0.0
    done: list[Timing] = []
    end: float | None = None
    while i < len(pending) or end is not None or replica.scheduler.has_unfinished():
        next_arrival = pending[i][0] if i < len(pending) else float("inf")
        if end is not None and end <= next_arrival:
            now = end
            done += replica.finish_step(now)
            end = None
        elif i < len(pending) and (end is None or next_arrival < end):
            now = max(now, next_arrival)
            while i < len(pending) and pending[i][0] <= now:
                t, req = pending[i]
                replica.add(req, Timing(req.request_id, t, req.num_prompt_tokens,
                                        req.sampling.max_tokens), now)
                i += 1
        if end is None:
            end = replica.start_step(now)
            if end is None and i >= len(pending):
                break
    return done
