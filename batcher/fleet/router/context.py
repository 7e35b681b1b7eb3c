"""The router's shared state: configuration, registry, policy, rollout weights, retry budget,
metrics, and the upstream attempts in flight (so an eviction can end them at once)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from yarl import URL

from batcher.fleet.router.discovery import Discovery
from batcher.fleet.router.health import HealthChecker, HealthConfig
from batcher.fleet.router.load import ReplicaLoad
from batcher.fleet.router.metrics import RouterMetrics
from batcher.fleet.router.ratelimit import KeyedRetryBudget
from batcher.fleet.router.policy import (
    POLICIES,
    Candidate,
    PolicyConfig,
    blocks_for,
    choose,
    choose_round_robin,
)
from batcher.fleet.router.registry import Registry, Replica
from batcher.fleet.router.rollout import Rollout
from batcher.http.upstream import UpstreamPool

log = logging.getLogger("batcher.fleet.context")


@dataclass(slots=True)
class RouterConfig:
    """Every router knob, validated once at start."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    routing: str = "predicted-wait"  # or "round-robin", the naive baseline for comparison
    health: HealthConfig = field(default_factory=HealthConfig)
    max_attempts: int = 3
    retry_ratio: float = 0.1
    retry_floor: int = 3
    retry_window: float = 10.0
    backoff_base: float = 0.025
    backoff_cap: float = 0.5
    beat_interval: float = 1.0
    suspect_beats: float = 3.0
    connect_timeout: float = 2.0
    upstream_timeout: float = 600.0  # a whole (non-streamed) answer
    stream_idle_timeout: float = 60.0  # no upstream byte for this long ends an attempt
    max_body_bytes: int = 4 * 2**20
    # The batch API: file uploads may be this large (streamed to a replica, never buffered),
    # and go only to these replica ids when any are named.
    max_upload_bytes: int = 100 * 2**20 + 2**16
    batch_pool: tuple[str, ...] = ()
    fleet_key: str | None = None  # required on /internal/heartbeat when set
    replica_admin_key: str | None = None  # for the replicas' /admin/drain and /v1/probe
    admin_key: str | None = None  # the router's own admin listener and /v1/probe
    max_replicas: int = 256
    beats_per_source: float = 50.0  # heartbeats per second one source address may send
    beat_burst: int = 100

    def validate(self) -> RouterConfig:
        self.policy.validate()
        self.health.validate()
        if self.routing not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if min(self.beat_interval, self.suspect_beats, self.connect_timeout,
               self.upstream_timeout, self.stream_idle_timeout) <= 0:
            raise ValueError("intervals and timeouts must be > 0")
        if self.backoff_base < 0 or self.backoff_cap < 0:
            raise ValueError("backoff must be >= 0")
        if self.max_upload_bytes < 1:
            raise ValueError("max_upload_bytes must be >= 1")
        if self.max_replicas < 1 or self.beats_per_source <= 0 or self.beat_burst < 1:
            raise ValueError("max_replicas, beats_per_source and beat_burst must be > 0")
        return self


RequestKey = tuple[str, str]  # (tenant scope, client request id)


class Attempt:
    """One upstream request in flight. `kill()` ends it from another task: its timeout fires at
    once and `killed` says why."""

    __slots__ = ("_timeout", "killed", "last_byte", "replica", "state_after", "stream",
                 "token")

    def __init__(self, replica: Replica, token: int, now: float, stream: bool = False):
        self.replica = replica
        self.token = token
        self.stream = stream  # its bytes show the replica's token progress
        self.last_byte = now
        self.killed: str | None = None
        self.state_after: str | None = None  # a state its answer carried, read once it ends
        self._timeout: asyncio.Timeout | None = None

    def arm(self, timeout: asyncio.Timeout, seconds: float) -> None:
        self._timeout = timeout
        self.extend(seconds)

    def extend(self, seconds: float) -> None:
        """Push the deadline `seconds` ahead (never past a kill)."""
        if self._timeout is not None and self.killed is None:
            with contextlib.suppress(RuntimeError):  # already expired or left
                self._timeout.reschedule(asyncio.get_running_loop().time() + seconds)

    def kill(self, reason: str) -> None:
        if self.killed is None:
            self.killed = reason
            if self._timeout is not None:
                with contextlib.suppress(RuntimeError):
                    self._timeout.reschedule(asyncio.get_running_loop().time())


class RouterContext:
    """Lives on the event loop; no locks."""

    def __init__(self, cfg: RouterConfig, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None):
        self.cfg = cfg.validate()
        self.clock = clock
        self.rng = rng or random.Random()
        self.use_registry(Registry(cfg.beat_interval, cfg.suspect_beats,
                                   max_replicas=cfg.max_replicas))
        self.rollout = Rollout()
        self.budget = KeyedRetryBudget(cfg.retry_ratio, cfg.retry_floor, cfg.retry_window)
        self.metrics = RouterMetrics()
        self.session: aiohttp.ClientSession | None = None
        # The generation hop's own client (`batcher.http.upstream`): a lean one, for the cost
        # every routed request pays; everything else the router sends goes through `session`.
        self.upstream: UpstreamPool | None = None
        self.health: HealthChecker | None = None
        self.attempts: dict[str, set[Attempt]] = {}
        # Client request ids are scoped by the caller's credential (`tenant_scope`), as the
        # replicas scope them by tenant: one caller can neither see nor cancel another's.
        self.owners: dict[RequestKey, str] = {}  # (scope, id) -> replica id now serving it
        self.cancelled: set[RequestKey] = set()  # cancelled by the client: errors are final
        # scope -> its untagged stored-response lookups in flight (`responses_proxy`)
        self.lookups: dict[str, int] = {}
        self.inflight = 0
        self.metrics.inflight.set_function(lambda: self.inflight)
        self.processes: Callable[[], list[dict[str, Any]]] | None = None  # set by the launcher
        self.discovery: Discovery | None = None  # set by `batcher router --discover`
        self.loads: dict[str, ReplicaLoad] = {}  # replica id -> the router's own account
        self._turn = 0  # round-robin's position
        self._urls: dict[tuple[str, str], URL] = {}
        self._later: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def use_registry(self, registry: Registry) -> None:
        """Route over `registry`; the load account learns of each state as it arrives (an
        event after it, such as a token or an end, then counts as "since" it)."""
        self.registry = registry
        registry.on_state = self._state_arrived
        registry.on_forget = self._forgotten

    def _forgotten(self, replica_id: str) -> None:
        self.metrics.forget_replica(replica_id)

    def _state_arrived(self, rep: Replica) -> None:
        load = self.loads.get(rep.replica_id)
        if load is not None:
            load.state_seen(rep.state_at)

    def upstream_url(self, rep: Replica, path: str) -> URL:
        """`path` on `rep`, parsed once per replica address and path (a request's hop)."""
        key = (rep.url, path)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) >= 4096:  # addresses move; the table stays small regardless
                self._urls.clear()
            url = self._urls[key] = URL(rep.url + path)
        return url

    def later(self, fn: Callable[..., Any], *args: Any) -> None:
        """Bookkeeping that need not delay an answer and that nothing routed next depends on
        (metrics, access lines, trace ends): run on the loop's next turn, after the handler's
        current step has written what it had, in the order given and all in one callback; at
        once when no loop runs."""
        if not self._later:
            try:
                asyncio.get_running_loop().call_soon(self._run_later)
            except RuntimeError:
                fn(*args)
                return
        self._later.append((fn, args))

    def _run_later(self) -> None:
        work, self._later = self._later, []
        for fn, args in work:
            try:
                fn(*args)
            except Exception:  # one failed record must not drop the others
                log.exception("router bookkeeping failed")

    # routing -------------------------------------------------------------------------------
    def candidates(self, now: float) -> list[Candidate]:
        reg = self.registry
        out = []
        for rep in reg:
            st = rep.state
            if st is None or not reg.routable(rep):
                continue
            load = self.loads.get(rep.replica_id)
            if load is None:  # nothing sent there yet: all it reports is others' work
                out.append(Candidate(rep.replica_id, st.free_blocks, st.total_blocks,
                                     st.block_size, st.waiting, st.version,
                                     fresh=not reg.suspect(rep, now), running=st.running,
                                     others=st.running + st.waiting))
                continue
            free = load.free_blocks(st.free_blocks, rep.unreflected_blocks, st.total_blocks,
                                    st.block_size)
            out.append(Candidate(rep.replica_id, free, st.total_blocks, st.block_size,
                                 st.waiting + rep.unreflected_count, st.version,
                                 fresh=not reg.suspect(rep, now), running=st.running,
                                 inflight=load.inflight,
                                 others=load.others(st.running, st.waiting),
                                 prefill_tokens=load.prefill_ahead(st.unserved_prefill_tokens),
                                 overdue_s=load.overdue_s(now),
                                 prefill_rate=load.prefill_rate, step_s=load.step_s))
        return out

    def pick(self, tokens: int, key: str | None, exclude: set[str],
             prompt_tokens: int | None = None) -> Replica | None:
        started = time.perf_counter()
        cands = self.candidates(self.clock())
        weights = self.rollout.weights or None
        if self.cfg.routing == "round-robin":
            c = choose_round_robin(cands, self._turn, self.rng, weights, exclude)
            self._turn += 1
        else:
            c = choose(cands, tokens, key, self.cfg.policy, self.rng, weights, exclude,
                       prompt_tokens=prompt_tokens)
        self.later(self.metrics.routing.observe, time.perf_counter() - started)
        return None if c is None else self.registry.get(c.replica_id)

    # attempts ------------------------------------------------------------------------------
    def begin(self, rep: Replica, tokens: int, stream: bool = False,
              prompt_tokens: int = 0) -> Attempt:
        st = rep.state
        blocks = blocks_for(tokens, st.block_size if st is not None else 16)
        now = self.clock()
        att = Attempt(rep, self.registry.reserve(rep, blocks, now), now, stream)
        self.attempts.setdefault(rep.replica_id, set()).add(att)
        load = self.loads.get(rep.replica_id)
        if load is None:
            load = self.loads[rep.replica_id] = ReplicaLoad()
            load.state_seen(rep.state_at)
        load.sent(att.token, prompt_tokens, now)
        return att

    def progress(self, att: Attempt, now: float) -> None:
        """A chunk of a streamed answer arrived: the first one ends the prefill."""
        if (load := self.loads.get(att.replica.replica_id)) is not None:
            load.token(att.token, now)

    def end(self, att: Attempt) -> None:
        self.registry.release(att.replica, att.token)
        if (load := self.loads.get(att.replica.replica_id)) is not None:
            load.done(att.token)
        live = self.attempts.get(att.replica.replica_id)
        if live is not None:
            live.discard(att)

    def on_evict(self, rep: Replica, reason: str) -> None:
        self.metrics.evictions.labels(rep.replica_id).inc()
        for att in list(self.attempts.get(rep.replica_id, ())):
            att.kill(f"replica {rep.replica_id} evicted: {reason}")

    def on_readmit(self, rep: Replica) -> None:
        self.metrics.readmissions.labels(rep.replica_id).inc()

    def stalled(self, replica_id: str, now: float) -> bool:
        """Token progress stopped: streams to the replica got no byte for `stall_after`
        seconds, or its last state shows running work and no engine step for that long."""
        limit = self.cfg.health.stall_after
        streams = [a.last_byte for a in self.attempts.get(replica_id, ()) if a.stream]
        if streams and now - max(streams) > limit:
            return True
        rep = self.registry.get(replica_id)
        st = rep.state if rep is not None else None
        return bool(st is not None and st.running > 0 and st.last_step_age is not None
                    and st.last_step_age > limit)

    def forget(self, replica_id: str) -> None:
        """Remove a replica and its health record (discovery saw its address go and its work
        finish). Attempts still running keep their own reference and end normally."""
        self.registry.remove(replica_id)
        if self.health is not None:
            self.health.forget(replica_id)
        if not self.attempts.get(replica_id):
            self.loads.pop(replica_id, None)
        if not self.attempts.get(replica_id, True):
            del self.attempts[replica_id]

    def report_failure(self, rep: Replica, reason: str, conclusive: bool = False) -> None:
        if self.health is not None:
            self.health.report_failure(rep, reason, conclusive)
