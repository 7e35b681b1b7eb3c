"""The fleet simulator's configuration and bookkeeping types: what fails when, the knobs, the
router's view of a replica, the retry budget and the record of one client request."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

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
    policy: str = "p2c-kv"
    heartbeat_interval: float = 1.0
    heartbeat_delay: float = 0.05
    stale_after: float = 3.0
    eject_on_refused: bool = True  # a refused connection takes the replica out at once
    reservations: bool = True
    piggyback: bool = False
    fit_check: bool = True
    max_waiting: int = 64
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
    seed: int = 0


class View:
    """The router's belief about one replica (the `ReplicaView` protocol)."""

    __slots__ = ("block_size", "fresh", "index", "measured_at", "now", "received_at",
                 "replica_id", "reported_free", "reserved", "running", "total_blocks", "waiting",
                 "zone")

    def __init__(self, rep: SimReplica) -> None:
        self.index, self.replica_id, self.zone = rep.index, rep.replica_id, rep.zone
        self.total_blocks, self.block_size = rep.total_blocks, rep.block_size
        self.update(rep, 0.0, 0.0)
        self.fresh = True
        self.now = 0.0

    def update(self, rep: SimReplica | tuple[int, int, int], measured: float, now: float) -> None:
        if isinstance(rep, SimReplica):
            self.reported_free, self.running, self.waiting = (rep.free_blocks, rep.running,
                                                              rep.waiting)
        else:
            self.reported_free, self.running, self.waiting = rep
        self.measured_at, self.received_at, self.reserved = measured, now, 0

    @property
    def free_blocks(self) -> int:
        return self.reported_free - self.reserved

    @property
    def age(self) -> float:
        return self.now - self.measured_at


class RetryBudget:
    """Retries in the last `window` s stay within max(floor, ratio x requests in the window)."""

    def __init__(self, ratio: float | None, floor: int, window: float) -> None:
        self.ratio, self.floor, self.window = ratio, floor, window
        self.requests: deque[float] = deque()
        self.retries: deque[float] = deque()
        self.denied = 0

    def note_request(self, now: float) -> None:
        self.requests.append(now)

    def try_spend(self, now: float) -> bool:
        if self.ratio is None:
            return True
        cut = now - self.window
        for q in (self.requests, self.retries):
            while q and q[0] < cut:
                q.popleft()
        if len(self.retries) + 1 > max(self.floor, self.ratio * len(self.requests)):
            self.denied += 1
            return False
        self.retries.append(now)
        return True


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
