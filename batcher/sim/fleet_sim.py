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
since (`reservations`), optionally refreshed by every response (`piggyback`). A replica is a
candidate while its last beat is younger than `stale_after`. A crashed replica sends nothing, so
until that timeout requests sent to it fail at once (connection refused) and are retried; with
`eject_on_refused` the first refusal takes it out of the candidates until it beats again.

Attempts: a replica refusing a request at its final fit check (queue full, or its whole KV need
above the free blocks) makes the router try one other candidate at once; further tries, and
every retry after a failure, are charged to the retry budget (a share of recent requests plus a
floor; `retry_ratio=None` means unlimited) and wait a jittered backoff. A request that streamed
tokens before its replica died is resumed elsewhere (prompt + tokens so far re-prefilled), also
under the budget. A request the budget refuses ends as an error (or rejected, if it never ran).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time

from batcher.config import SchedulerConfig
from batcher.request import Request
from batcher.sampling import SamplingParams
from batcher.sim.engine_sim import SYNTHETIC_TOKEN, SimReplica, Timing
from batcher.sim.fleet_types import Failure, FleetConfig, Record, RetryBudget, View
from batcher.sim.metrics import Collector, FleetResult
from batcher.sim.policies import RouteRequest, RoutingPolicy, make_policy
from batcher.sim.stepmodel import StepModel
from batcher.sim.workload import ArrivalSpec, RequestGen, ShapeSpec

__all__ = ["Failure", "FleetConfig", "FleetSim", "Record", "RetryBudget", "View"]

ARRIVE, STEP, KICK, BEAT, BEAT_RECV, RETRY, FAIL, RECOVER, SWEEP, SAMPLE = range(10)
# NOTE: an idle replica starts its step a nanosecond after a request reaches it, so that
# requests arriving at the same instant share the first step, as in the engine.
KICK_DELAY = 1e-9


class FleetSim:
    """Build with a config, a step model, a request shape and an arrival process; `run()`."""

    def __init__(self, cfg: FleetConfig, step_model: StepModel, shape: ShapeSpec,
                 arrivals: ArrivalSpec, policy: RoutingPolicy | None = None) -> None:
        self.cfg = cfg
        sc = SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len)
        self.replicas = [SimReplica(i, sc, cfg.num_blocks, cfg.block_size, step_model,
                                    zone=i % cfg.zones, prefix_caching=cfg.prefix_caching)
                         for i in range(cfg.replicas)]
        self.views = [View(r) for r in self.replicas]
        self.cands = list(self.views)
        self.policy = policy or make_policy(cfg.policy, cfg.seed)
        self.rng = random.Random(cfg.seed + 1)
        self.gen = RequestGen(shape, cfg.seed + 2)
        self.arrivals = arrivals.times(cfg.duration, random.Random(cfg.seed + 3))
        self.budget = RetryBudget(cfg.retry_ratio, cfg.retry_floor, cfg.retry_window)
        self.stats = Collector(cfg)
        self.epoch = [0] * cfg.replicas
        self.kicked = [False] * cfg.replicas
        self.heap: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self.inflight = 0
        self.n_requests = 0
        self.now = 0.0

    def _push(self, t: float, kind: int, payload: object = None) -> None:
        heapq.heappush(self.heap, (t, next(self._seq), kind, payload))

    def run(self) -> FleetResult:
        cfg, push = self.cfg, self._push
        first = next(self.arrivals, None)
        more = first is not None
        if more:
            push(first, ARRIVE)
        for r in self.replicas:
            push(self.rng.random() * cfg.heartbeat_interval, BEAT, r.index)
        for f in cfg.failures:
            push(f.at, FAIL, f)
        push(0.25, SWEEP)
        push(1.0, SAMPLE)
        hard_end = cfg.duration + cfg.drain_limit
        events = 0
        wall0 = time.perf_counter()
        heap, pop, reps = self.heap, heapq.heappop, self.replicas
        while heap:
            t, _, kind, a = pop(heap)
            if t > hard_end or (not more and self.inflight == 0 and kind >= BEAT):
                break
            events += 1
            self.now = t
            if kind == STEP:
                idx, ep = a  # type: ignore[misc]
                if ep != self.epoch[idx]:
                    continue
                rep = reps[idx]
                for tm in rep.finish_step(t):
                    self._complete(tm, t, rep)
                end = rep.start_step(t)
                if end is not None:
                    push(end, STEP, (idx, ep))
            elif kind == KICK:
                idx, ep = a  # type: ignore[misc]
                self.kicked[idx] = False
                rep = reps[idx]
                if ep == self.epoch[idx] and rep.alive and not rep.busy:
                    end = rep.start_step(t)
                    if end is not None:
                        push(end, STEP, (idx, ep))
            elif kind == ARRIVE:
                self._new_request(t)
                nxt = next(self.arrivals, None)
                if nxt is None:
                    more = False
                else:
                    push(nxt, ARRIVE)
            elif kind == BEAT:
                rep = reps[a]  # type: ignore[index]
                if rep.alive:
                    push(t + cfg.heartbeat_delay, BEAT_RECV,
                         (a, t, (rep.free_blocks, rep.running, rep.waiting)))
                push(t + cfg.heartbeat_interval, BEAT, a)
            elif kind == BEAT_RECV:
                idx, sent, snap = a  # type: ignore[misc]
                v = self.views[idx]
                if sent >= v.measured_at:
                    v.update(snap, sent, t)
                    if not v.fresh:
                        v.fresh = True
                        self._rebuild()
            elif kind == RETRY:
                self._route(a, t, free_tries=1)  # type: ignore[arg-type]
            elif kind == SWEEP:
                self._sweep(t)
                push(t + 0.25, SWEEP)
            elif kind == SAMPLE:
                self.stats.sample(t, reps, self.cands)
                push(t + 1.0, SAMPLE)
            elif kind == FAIL:
                self._fail(a, t)  # type: ignore[arg-type]
            elif kind == RECOVER:
                for idx in a:  # type: ignore[union-attr]
                    reps[idx].restart(t)
        wall = time.perf_counter() - wall0
        return self.stats.result(self, events, wall)

    # routing --------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        self.cands = [v for v in self.views if v.fresh]

    def _sweep(self, t: float) -> None:
        changed = False
        for v in self.views:
            v.now = t
            fresh = t - v.received_at <= self.cfg.stale_after
            if fresh != v.fresh:
                v.fresh, changed = fresh, True
        if changed:
            self._rebuild()

    def _new_request(self, t: float) -> None:
        p, o, g = self.gen.lengths()
        rec = Record(self.n_requests, t, p, o, g)
        self.n_requests += 1
        self.inflight += 1
        self.budget.note_request(t)
        self._route(rec, t, free_tries=1)

    def _route(self, rec: Record, t: float, free_tries: int) -> None:
        policy = self.policy
        views = [r for r in self.replicas if r.alive] if policy.live else self.cands
        prompt: list[int] | None = None
        if getattr(policy, "wants_prefix", False):
            prompt = self.gen.prompt(rec.index, rec.prompt, rec.group)
        req = RouteRequest(str(rec.index), rec.prompt + rec.tokens, rec.max_tokens - rec.tokens,
                           prompt or (), frozenset(rec.tried))
        i = policy.choose(views, req) if views else None
        if i is None:
            rec.attempts += 1
            return self._retry(rec, t, "no candidate")
        idx = views[i].index
        rep = self.replicas[idx]
        rec.attempts += 1
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
        if prompt is None:
            prompt = self.gen.prompt(rec.index, rec.prompt, rec.group)
        if rec.tokens:
            prompt = prompt + [SYNTHETIC_TOKEN] * rec.tokens
        sp = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
        r = Request(f"{rec.index}#{rec.attempts}", prompt, sp, arrival_time=t)
        try:
            rep.add(r, Timing(r.request_id, t, len(prompt), req.max_tokens, owner=rec), t)
        except ValueError:  # can never fit this replica: a client error, not retried
            return self._end(rec, t, "rejected")
        if self.cfg.reservations:
            self.views[idx].reserved += -(-req.tokens // rep.block_size)
        if not rep.busy and not self.kicked[idx]:
            self.kicked[idx] = True
            self._push(t + KICK_DELAY, KICK, (idx, self.epoch[idx]))

    def _retry(self, rec: Record, t: float, reason: str) -> None:
        cfg = self.cfg
        self.stats.attempt_failures[reason] = self.stats.attempt_failures.get(reason, 0) + 1
        if rec.attempts >= cfg.max_attempts or not self.budget.try_spend(t):
            self._end(rec, t, "error" if rec.tokens or reason != "capacity" else "rejected")
            return
        rec.retries += 1
        if len(rec.tried) >= len(self.replicas) - 1:
            rec.tried.clear()
        delay = self.rng.random() * min(cfg.backoff_cap, cfg.backoff_base * 2 ** rec.retries)
        self._push(t + delay, RETRY, rec)

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
        if self.cfg.piggyback:
            self.views[rep.index].update(rep, t, t)
        self._end(rec, t, "ok")

    def _end(self, rec: Record, t: float, outcome: str) -> None:
        self.inflight -= 1
        self.stats.finish(rec, t, outcome)

    def _fail(self, f: Failure, t: float) -> None:
        targets = ([r.index for r in self.replicas if r.zone == f.zone] if f.zone is not None
                   else [f.replica])
        for idx in targets:
            rep = self.replicas[idx]  # type: ignore[index]
            if not rep.alive:
                continue
            self.epoch[rep.index] += 1
            for tm in rep.fail(t):
                rec = self._merge(tm)
                if rec.tokens:
                    rec.failovers += 1
                    self.stats.failovers += 1
                    if rec.tokens >= rec.max_tokens:
                        self._end(rec, t, "ok")
                        continue
                self._retry(rec, t, "replica failed")
        if f.duration < math.inf:
            self._push(t + f.duration, RECOVER, targets)
