"""The fleet simulator's configuration and bookkeeping types: what fails or stalls when, the
knobs, the router's view of a replica and the record of one client request. The retry budget is
the fleet router's own (`batcher.fleet.router.retry_budget.RetryBudget`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from batcher.core.config import SchedulerConfig
from batcher.fleet.router.load import ReplicaLoad
from batcher.sim.engine_sim import SimReplica


@dataclass(slots=True, frozen=True)
class Failure:
    """Replica `replica` (or every replica of `zone`) fails at `at` for `duration` seconds."""

    at: float
    zone: int | None = None
    replica: int | None = None
    duration: float = math.inf

    def __post_init__(self) -> None:
        if (self.zone is None) == (self.replica is None):
            raise ValueError("a failure names either a zone or a replica")
        if self.at < 0 or not self.duration > 0:
            raise ValueError("a failure needs at >= 0 and duration > 0")


@dataclass(slots=True, frozen=True)
class Stall:
    """Replica `replica` takes no step from `at` for `duration` seconds (a wedged engine that
    still answers heartbeats: its state shows work and no progress)."""

    replica: int
    at: float
    duration: float

    def __post_init__(self) -> None:
        if self.replica < 0 or self.at < 0 or not self.duration > 0:
            raise ValueError("a stall needs replica >= 0, at >= 0 and duration > 0")


@dataclass(slots=True)
class FleetConfig:
    replicas: int = 16
    zones: int = 3
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 320
    max_model_len: int = 4096
    num_blocks: int = 4096
    block_size: int = 16
    prefix_caching: bool = True
    policy: str = "fleet"  # the fleet router's own policy
    heartbeat_interval: float = 1.0
    heartbeat_delay: float = 0.05
    stale_after: float = 3.0
    eject_on_refused: bool = True  # a refused connection takes the replica out at once
    reservations: bool = True
    piggyback: bool = True  # the router reads the state on every answer's headers
    fit_check: bool = True
    max_waiting: int = 64
    # Replicas admit as `batcher serve` does (`Admission`: predicted TTFT within `slo_ttft`, one
    # more stream within `slo_tpot`); a refusal is the same 503 as a failed fit check.
    admission: bool = False
    retry_ratio: float | None = 0.1
    retry_floor: int = 3
    retry_window: float = 10.0
    max_attempts: int = 5
    backoff_base: float = 0.05
    backoff_cap: float = 2.0
    slo_ttft: float = 1.0  # a sub-second first token
    slo_tpot: float = 0.2  # 5 tokens/s per stream, what the CPU defaults aim for
    duration: float = 60.0
    warmup: float = 0.0  # requests arriving earlier are not measured
    drain_limit: float = 300.0  # after the last arrival, stop at most this much later
    failures: list[Failure] = field(default_factory=list)
    # heterogeneity: the first `slow_replicas` step `slow_factor` times slower; the next
    # `small_kv_replicas` have `small_kv_blocks` KV blocks
    slow_replicas: int = 0
    slow_factor: float = 1.0
    small_kv_replicas: int = 0
    small_kv_blocks: int = 0
    stalls: list[Stall] = field(default_factory=list)
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.slow_replicas <= self.replicas or not self.slow_factor > 0:
            raise ValueError("slow replicas: 0 <= K <= replicas and a factor > 0")
        if self.slow_replicas + self.small_kv_replicas > self.replicas or (
                self.small_kv_replicas and self.small_kv_blocks < 1):
            raise ValueError("small-KV replicas: K + slow replicas <= replicas, blocks >= 1")
        if any(s.replica >= self.replicas for s in self.stalls):
            raise ValueError("a stall names a replica beyond --replicas")

    def scheduler_config(self) -> SchedulerConfig:
        """Every replica's scheduler, and the one its capacity is measured on: `batcher serve`'s
        at its defaults with this fleet's slots, step budget and model length, pacing first
        tokens to the TTFT SLO that goodput counts, as `batcher serve` paces to its
        --slo-ttft-ms (also its goodput threshold). The TPOT SLO counts goodput (and bounds
        admission, when on) but is no step target: serve's scheduler has none unless
        --slo-tpot-ms is given."""
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                               slo_ttft_s=self.slo_ttft if self.slo_ttft > 0 else None)

    def speed_factor(self, index: int) -> float:
        return self.slow_factor if index < self.slow_replicas else 1.0

    def blocks_of(self, index: int) -> int:
        small = self.slow_replicas <= index < self.slow_replicas + self.small_kv_replicas
        return self.small_kv_blocks if small else self.num_blocks


class View:
    """The router's belief about one replica (the `ReplicaView` protocol): the last reported
    state with the router's unreflected requests applied, plus the fleet router's own
    `ReplicaLoad` account (its requests in flight there, their prompt tokens still without a
    first token, and the rates it measured)."""

    __slots__ = (
        "block_size",
        "clock",
        "fresh",
        "index",
        "load",
        "measured_at",
        "received_at",
        "replica_id",
        "reported_free",
        "reported_unserved",
        "reported_waiting",
        "reserved",
        "running",
        "total_blocks",
        "unreflected",
        "zone",
    )

    def __init__(self, rep: SimReplica, clock: SimClock) -> None:
        self.index, self.replica_id, self.zone = rep.index, rep.replica_id, rep.zone
        self.total_blocks, self.block_size = rep.total_blocks, rep.block_size
        self.clock = clock
        self.update(rep, 0.0, 0.0)
        self.fresh = True
        self.load = ReplicaLoad()

    def update(self, rep: SimReplica | tuple[int, int, int, int], measured: float,
               now: float) -> None:
        if isinstance(rep, SimReplica):
            (self.reported_free, self.running, self.reported_waiting,
             self.reported_unserved) = (rep.free_blocks, rep.running, rep.waiting,
                                        rep.unserved_prefill_tokens)
        else:
            (self.reported_free, self.running, self.reported_waiting,
             self.reported_unserved) = rep
        # requests sent since this state was measured and still in flight (the registry's
        # `unreflected`): the state cannot show them yet
        self.measured_at, self.received_at, self.reserved = measured, now, 0
        self.unreflected: set[int] = set()  # sent since `measured_at` and still in flight
        if hasattr(self, "load"):
            self.load.state_seen(measured)

    @property
    def free_blocks(self) -> int:
        return self.load.free_blocks(self.reported_free, self.reserved, self.total_blocks,
                                     self.block_size)

    @property
    def waiting(self) -> int:
        return self.reported_waiting + len(self.unreflected)

    @property
    def age(self) -> float:
        return self.clock.now - self.measured_at

    @property
    def inflight(self) -> int:
        return self.load.inflight

    @property
    def others(self) -> int:
        """Reported sequences beyond the router's own requests that the report could show."""
        return self.load.others(self.running, self.reported_waiting)

    @property
    def prefill_tokens(self) -> int:
        return self.load.prefill_ahead(self.reported_unserved)

    @property
    def prefill_rate(self) -> float | None:
        return self.load.prefill_rate

    @property
    def step_s(self) -> float | None:
        return self.load.step_s

    @property
    def overdue_s(self) -> float:
        return self.load.overdue_s(self.clock.now)

    def sent(self, rec: int, prompt: int, blocks: int, now: float) -> None:
        self.reserved += blocks
        self.unreflected.add(rec)
        self.load.sent(rec, prompt, now)

    def done(self, rec: int) -> None:
        self.unreflected.discard(rec)
        self.load.done(rec)


class SimClock:
    """The simulated time, shared by the views so ages need no argument."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0


@dataclass(slots=True)
class Record:
    """One client request across its attempts."""

    index: int
    arrival: float
    prompt: int
    max_tokens: int
    group: int
    tried: set[int] = field(default_factory=set)
    attempts: int = 0
    retries: int = 0
    failovers: int = 0
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    replica: int = -1  # where its current attempt runs


class LiveView:
    """A replica as an all-knowing router would see it (for the oracle): its state now, the
    prefill tokens really left in its queue, its true rates, and how long a stall has to run."""

    __slots__ = ("clock", "prefill_rate", "rep", "stall_until", "step_s")

    def __init__(self, rep: SimReplica, clock: SimClock, prefill_rate: float,
                 step_s: float) -> None:
        self.rep, self.clock = rep, clock
        self.prefill_rate, self.step_s = prefill_rate, step_s
        self.stall_until = 0.0

    def __getattr__(self, name: str) -> object:  # index, replica_id, zone, KV and queue numbers
        return getattr(self.rep, name)

    @property
    def fresh(self) -> bool:
        return True

    @property
    def age(self) -> float:
        return 0.0

    @property
    def inflight(self) -> int:
        return self.rep.running + self.rep.waiting

    @property
    def others(self) -> int:
        return 0

    @property
    def prefill_tokens(self) -> int:
        s = self.rep.scheduler
        return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens)
                   for q in (s.running, s.waiting) for r in q)

    @property
    def overdue_s(self) -> float:
        return max(0.0, self.stall_until - self.clock.now)
