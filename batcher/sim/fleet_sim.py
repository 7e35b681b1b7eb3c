"""A discrete-event fleet: arrivals, a router with stale heartbeat state, N `SimReplica`s (the
real scheduler and block pool each), failures, and retries under a budget.

Events, in one heap ordered by (time, sequence): an arrival; a replica's step ending; a replica
sending a heartbeat and the router receiving it `heartbeat_delay` later; a retry after its
backoff; a replica or zone failing and coming back; the router's staleness sweep; a metrics
sample. Dispatch from router to replica is immediate (a millisecond of network changes nothing
at these step times); a replica that is idle starts a step at once (after every request of the
same instant has reached it), a busy one takes the request at its next step boundary, as the
engine does.

The router's view of a replica is its last heartbeat, minus the KV blocks of requests sent to it
since (`reservations`), optionally refreshed by every response (`piggyback`), plus what the
router knows exactly: its requests in flight there, the prompt tokens of those without a first
token yet, and the prefill rate and decode step it measured from its own requests' first tokens
and token gaps (as the fleet router does from streams). A replica is a
candidate while its last beat is younger than `stale_after`. A crashed replica sends nothing, so
until that timeout requests sent to it fail at once (connection refused) and are retried; with
`eject_on_refused` the first refusal takes it out of the candidates until it beats again.

Attempts: a replica refusing a request at its final fit check (queue full, or its whole KV need
above the free blocks) makes the router try one other candidate at once; further tries, and
every retry after a failure, are charged to the retry budget (a share of recent requests plus a
floor; `retry_ratio=None` means unlimited) and wait a jittered backoff. A request that streamed
tokens before its replica died is resumed elsewhere (prompt + tokens so far re-prefilled), also
under the budget (the fleet router's own `RetryBudget`). A request the budget refuses ends as
an error (or rejected, if it never ran).

Heterogeneity (`FleetConfig`): slow replicas run a `ScaledStepModel`, small-KV replicas a
smaller block pool, and a stall holds every step of one replica that overlaps its window until
the window ends.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Callable

from batcher.admission.admission import Rejected
from batcher.fleet.router.retry_budget import RetryBudget
from batcher.core.request import Request
from batcher.core.sampling import SamplingParams
from batcher.sim.engine_sim import SYNTHETIC_TOKEN, SimReplica, Timing
from batcher.sim.fleet_types import Failure, FleetConfig, LiveView, Record, SimClock, View
from batcher.sim.metrics import Collector, FleetResult
from batcher.sim.policies import RouteRequest, RoutingPolicy, make_policy
from batcher.sim.stepmodel import ScaledStepModel, StepModel
from batcher.sim.workload import ArrivalSpec, RequestGen, ShapeSpec

__all__ = ["Failure", "FleetConfig", "FleetSim", "Record", "View"]

ARRIVE, STEP, KICK, BEAT, BEAT_RECV, RETRY, FAIL, RECOVER, SWEEP, SAMPLE = range(10)
# NOTE: an idle replica starts its step a nanosecond after a request reaches it, so that
# requests arriving at the same instant share the first step, as in the engine.
KICK_DELAY = 1e-9
SWEEP_EVERY = 0.25
SAMPLE_EVERY = 1.0


class FleetSim:
    """Build with a config, a step model, a request shape and an arrival process; `run()`."""

    def __init__(self, cfg: FleetConfig, step_model: StepModel, shape: ShapeSpec,
                 arrivals: ArrivalSpec, policy: RoutingPolicy | None = None) -> None:
        self.cfg = cfg
        self.clock = SimClock()
        self.replicas = self._build_replicas(cfg, step_model)
        self.views = [View(r, self.clock) for r in self.replicas]
        self.cands = list(self.views)
        self.policy = policy or make_policy(cfg.policy, cfg.seed, cfg.slo_ttft)
        self.live = self._live_views(step_model) if self.policy.live else []
        self.rng = random.Random(cfg.seed + 1)
        self.gen = RequestGen(shape, cfg.seed + 2)
        self.arrivals = arrivals.times(cfg.duration, random.Random(cfg.seed + 3))
        self.budget = (RetryBudget(cfg.retry_ratio, cfg.retry_floor, cfg.retry_window)
                       if cfg.retry_ratio is not None else None)
        self.budget_denied = 0
        self.stats = Collector(cfg)
        self.epoch = [0] * cfg.replicas
        self.kicked = [False] * cfg.replicas
        self.heap: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self.inflight = 0
        self.n_requests = 0
        self.more = True  # arrivals left
        self.handlers: dict[int, Callable[[float, object], None]] = {
            ARRIVE: self._on_arrive, STEP: self._on_step, KICK: self._on_kick,
            BEAT: self._on_beat, BEAT_RECV: self._on_beat_recv, RETRY: self._on_retry,
            FAIL: self._on_fail, RECOVER: self._on_recover, SWEEP: self._on_sweep,
            SAMPLE: self._on_sample}

    @property
    def now(self) -> float:
        return self.clock.now

    def _build_replicas(self, cfg: FleetConfig, model: StepModel) -> list[SimReplica]:
        sc = cfg.scheduler_config()
        reps = []
        for i in range(cfg.replicas):
            factor = cfg.speed_factor(i)
            m = model if factor == 1.0 else ScaledStepModel(model, factor)
            rep = SimReplica(i, sc, cfg.blocks_of(i), cfg.block_size, m, zone=i % cfg.zones,
                             prefix_caching=cfg.prefix_caching)
            rep.on_token = self._on_token
            if cfg.admission:
                rep.use_admission(slo_ttft_s=cfg.slo_ttft, slo_tpot_s=cfg.slo_tpot,
                                  max_waiting=cfg.max_waiting, max_num_seqs=cfg.max_num_seqs)
            reps.append(rep)
        return reps

    def _live_views(self, model: StepModel) -> list[LiveView]:
        from batcher.sim.calibrate import rates_from_model

        pre, dec = rates_from_model(model, 16, 512, self.cfg.max_num_batched_tokens)
        out = []
        for r in self.replicas:
            f = self.cfg.speed_factor(r.index)
            out.append(LiveView(r, self.clock, pre / f, 16 / dec * f))
        for st in self.cfg.stalls:
            out[st.replica].stall_until = st.at + st.duration
        return out

    def _push(self, t: float, kind: int, payload: object = None) -> None:
        heapq.heappush(self.heap, (t, next(self._seq), kind, payload))

    # the event loop -------------------------------------------------------------------------
    def run(self) -> FleetResult:
        self._seed_events()
        events, wall0 = self._loop()
        return self.stats.result(self.replicas, self.policy.name, self.budget_denied,
                                 self.now, events, time.perf_counter() - wall0)

    def _seed_events(self) -> None:
        cfg = self.cfg
        first = next(self.arrivals, None)
        self.more = first is not None
        if first is not None:
            self._push(first, ARRIVE)
        for r in self.replicas:
            self._push(self.rng.random() * cfg.heartbeat_interval, BEAT, r.index)
        for f in cfg.failures:
            self._push(f.at, FAIL, f)
        self._push(SWEEP_EVERY, SWEEP)
        self._push(SAMPLE_EVERY, SAMPLE)

    def _loop(self) -> tuple[int, float]:
        hard_end = self.cfg.duration + self.cfg.drain_limit
        heap, pop, handlers, clock = self.heap, heapq.heappop, self.handlers, self.clock
        events = 0
        wall0 = time.perf_counter()
        while heap:
            t, _, kind, a = pop(heap)
            if t > hard_end or (not self.more and self.inflight == 0 and kind >= BEAT):
                break
            events += 1
            clock.now = t
            handlers[kind](t, a)
        return events, wall0

    # replicas stepping ----------------------------------------------------------------------
    def _start(self, idx: int, t: float) -> None:
        end = self.replicas[idx].start_step(t)
        if end is not None:
            self._push(self._stretch(idx, t, end), STEP, (idx, self.epoch[idx]))

    def _stretch(self, idx: int, start: float, end: float) -> float:
        """A step overlapping a stall of its replica ends that much later."""
        for st in self.cfg.stalls:
            if st.replica == idx and start < st.at + st.duration and end > st.at:
                end += st.at + st.duration - max(start, st.at)
        return end

    def _on_step(self, t: float, a: object) -> None:
        idx, ep = a  # type: ignore[misc]
        if ep != self.epoch[idx]:
            return
        rep = self.replicas[idx]
        for tm in rep.finish_step(t):
            self._complete(tm, t, rep)
        self._start(idx, t)

    def _on_kick(self, t: float, a: object) -> None:
        idx, ep = a  # type: ignore[misc]
        self.kicked[idx] = False
        rep = self.replicas[idx]
        if ep == self.epoch[idx] and rep.alive and not rep.busy:
            self._start(idx, t)

    def _on_token(self, tm: Timing, now: float) -> None:
        rec: Record = tm.owner  # type: ignore[assignment]
        view = self.views[rec.replica]
        first = rec.index in view.load.pending
        view.load.token(rec.index, now)
        if first and self.cfg.piggyback:
            # A stream's headers leave with its first token and carry the replica's state
            # then (`X-Replica-State`), as the fleet router reads it.
            view.update(self.replicas[rec.replica], now, now)

    # arrivals, heartbeats, sweeps, samples -------------------------------------------------
    def _on_arrive(self, t: float, a: object) -> None:
        self._new_request(t)
        nxt = next(self.arrivals, None)
        if nxt is None:
            self.more = False
        else:
            self._push(nxt, ARRIVE)

    def _on_beat(self, t: float, a: object) -> None:
        rep = self.replicas[a]  # type: ignore[index]
        if rep.alive:
            self._push(t + self.cfg.heartbeat_delay, BEAT_RECV,
                       (a, t, (rep.free_blocks, rep.running, rep.waiting,
                                  rep.unserved_prefill_tokens)))
        self._push(t + self.cfg.heartbeat_interval, BEAT, a)

    def _on_beat_recv(self, t: float, a: object) -> None:
        idx, sent, snap = a  # type: ignore[misc]
        v = self.views[idx]
        if sent >= v.measured_at:
            v.update(snap, sent, t)
            if not v.fresh:
                v.fresh = True
                self._rebuild()

    def _on_retry(self, t: float, a: object) -> None:
        self._route(a, t, free_tries=1)  # type: ignore[arg-type]

    def _on_sweep(self, t: float, a: object) -> None:
        changed = False
        for v in self.views:
            fresh = t - v.received_at <= self.cfg.stale_after
            if fresh != v.fresh:
                v.fresh, changed = fresh, True
        if changed:
            self._rebuild()
        self._push(t + SWEEP_EVERY, SWEEP)

    def _on_sample(self, t: float, a: object) -> None:
        self.stats.sample(t, self.replicas, self.cands)
        self._push(t + SAMPLE_EVERY, SAMPLE)

    def _rebuild(self) -> None:
        self.cands = [v for v in self.views if v.fresh]

    # routing --------------------------------------------------------------------------------
    def _new_request(self, t: float) -> None:
        p, o, g = self.gen.lengths()
        rec = Record(self.n_requests, t, p, o, g)
        self.n_requests += 1
        self.inflight += 1
        if self.budget is not None:
            self.budget.note_request(t)
        self._route(rec, t, free_tries=1)

    def _candidates(self) -> list:
        if self.policy.live:
            return [v for v in self.live if v.rep.alive]
        return self.cands

    def _route(self, rec: Record, t: float, free_tries: int) -> None:
        policy = self.policy
        views = self._candidates()
        prompt: list[int] | None = None
        if getattr(policy, "wants_prefix", False):
            prompt = self.gen.prompt(rec.index, rec.prompt, rec.group)
        req = RouteRequest(str(rec.index), rec.prompt + rec.tokens, rec.max_tokens - rec.tokens,
                           prompt or (), frozenset(rec.tried))
        i = policy.choose(views, req) if views else None
        rec.attempts += 1
        if i is None:
            return self._retry(rec, t, "no candidate")
        idx = views[i].index
        rep = self.replicas[idx]
        rec.tried.add(idx)
        self.stats.routed[idx] += 1
        if not rep.alive:
            if self.cfg.eject_on_refused and self.views[idx].fresh:
                self.views[idx].fresh = False  # passive health check: out until it beats again
                self._rebuild()
            return self._retry(rec, t, "refused")
        if self.cfg.fit_check and not rep.fits(req.prompt_tokens, req.max_tokens,
                                              self.cfg.max_waiting):
            self.stats.capacity_rejects += 1
            if free_tries > 0:
                return self._route(rec, t, free_tries - 1)
            return self._retry(rec, t, "capacity")
        self._dispatch(rec, req, rep, prompt, t)

    def _dispatch(self, rec: Record, req: RouteRequest, rep: SimReplica,
                  prompt: list[int] | None, t: float) -> None:
        idx = rep.index
        if prompt is None:
            prompt = self.gen.prompt(rec.index, rec.prompt, rec.group)
        if rec.tokens:
            prompt = prompt + [SYNTHETIC_TOKEN] * rec.tokens
        sp = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
        r = Request(f"{rec.index}#{rec.attempts}", prompt, sp, arrival_time=t)
        try:
            rep.offer(r, Timing(r.request_id, t, len(prompt), req.max_tokens, owner=rec), t)
        except Rejected:  # the replica's admission: a 503, retried like a failed fit check
            self.stats.capacity_rejects += 1
            return self._retry(rec, t, "capacity")
        except ValueError:  # can never fit this replica: a client error, not retried
            return self._end(rec, t, "rejected")
        rec.replica = idx
        blocks = -(-req.tokens // rep.block_size) if self.cfg.reservations else 0
        self.views[idx].sent(rec.index, req.prompt_tokens, blocks, t)
        if not rep.busy and not self.kicked[idx]:
            self.kicked[idx] = True
            self._push(t + KICK_DELAY, KICK, (idx, self.epoch[idx]))

    def _retry(self, rec: Record, t: float, reason: str) -> None:
        cfg = self.cfg
        self.stats.attempt_failures[reason] = self.stats.attempt_failures.get(reason, 0) + 1
        if rec.attempts >= cfg.max_attempts or not self._spend(t):
            self._end(rec, t, "error" if rec.tokens or reason != "capacity" else "rejected")
            return
        rec.retries += 1
        if len(rec.tried) >= len(self.replicas) - 1:
            rec.tried.clear()
        delay = self.rng.random() * min(cfg.backoff_cap, cfg.backoff_base * 2 ** rec.retries)
        self._push(t + delay, RETRY, rec)

    def _spend(self, t: float) -> bool:
        if self.budget is None:
            return True
        if self.budget.try_spend(t, self.inflight):
            return True
        self.budget_denied += 1
        return False

    # outcomes -------------------------------------------------------------------------------
    def _merge(self, tm: Timing) -> Record:
        rec: Record = tm.owner  # type: ignore[assignment]
        if tm.tokens:
            if rec.first_token is None:
                rec.first_token = tm.first_token
            rec.last_token = tm.last_token
            rec.tokens += tm.tokens
        return rec

    def _complete(self, tm: Timing, t: float, rep: SimReplica) -> None:
        rec = self._merge(tm)
        self.views[rep.index].done(rec.index)
        self._end(rec, t, "ok")

    def _end(self, rec: Record, t: float, outcome: str) -> None:
        self.inflight -= 1
        self.stats.finish(rec, t, outcome)

    def _on_fail(self, t: float, a: object) -> None:
        f: Failure = a  # type: ignore[assignment]
        targets = ([r.index for r in self.replicas if r.zone == f.zone] if f.zone is not None
                   else [f.replica])
        for idx in targets:
            rep = self.replicas[idx]  # type: ignore[index]
            if rep.alive:
                self._crash(rep, t)
        if f.duration < math.inf:
            self._push(t + f.duration, RECOVER, targets)

    def _crash(self, rep: SimReplica, t: float) -> None:
        self.epoch[rep.index] += 1
        for tm in rep.fail(t):
            rec = self._merge(tm)
            self.views[rep.index].done(rec.index)
            if rec.tokens:
                rec.failovers += 1
                self.stats.failovers += 1
                if rec.tokens >= rec.max_tokens:
                    self._end(rec, t, "ok")
                    continue
            self._retry(rec, t, "replica failed")

    def _on_recover(self, t: float, a: object) -> None:
        for idx in a:  # type: ignore[union-attr]
            self.replicas[idx].restart(t)
