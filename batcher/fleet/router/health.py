"""Three-layer health: liveness (`GET /health`, short timeout), readiness (`GET /ready`, or the
polled `/v1/state` for replicas that do not heartbeat) and the one-token deep probe
(`POST /v1/probe?timeout=D`).

Contract:
- Each replica is checked every `interval` seconds (start to start), so a SIGSTOPped process
  (connections accepted, nothing answered) fails once per interval on the liveness timeout.
- The deep probe runs beside the rounds (one at a time per replica): every `probe_interval`, on
  every round while a replica has recent failures or is evicted, and when its token progress
  stalls (`stalled(replica_id, now)`, at most once per `stall_after`).
- `evict_after` consecutive failures of liveness (or of the deep probe) evict; an evicted
  replica returns after `readmit_after` consecutive passing deep probes. A replica that never
  answered yet (still starting) is not counted as failing; it is simply not routable until it
  has a state. Readiness failures only stop routing (a draining replica is alive); they never
  count as failures.
- `HealthRecord` is the pure state machine; `HealthChecker` does the HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import orjson

from batcher.fleet.router.registry import Registry, Replica

log = logging.getLogger("batcher.fleet.health")
_NOT_ALLOWED = "not allowed"  # the replica refused the probe itself (no key, rate limit)


@dataclass(slots=True)
class HealthConfig:
    interval: float = 0.5
    liveness_timeout: float = 0.5
    probe_interval: float = 5.0
    probe_deadline: float = 2.0
    evict_after: int = 3
    readmit_after: int = 2
    stall_after: float = 2.0

    def validate(self) -> HealthConfig:
        if min(self.interval, self.liveness_timeout, self.probe_interval,
               self.probe_deadline, self.stall_after) <= 0:
            raise ValueError("health intervals and timeouts must be > 0")
        if self.evict_after < 1 or self.readmit_after < 1:
            raise ValueError("evict_after and readmit_after must be >= 1")
        return self


@dataclass(slots=True)
class HealthRecord:
    """Consecutive failures and passes of one replica."""

    evicted: bool = False
    fails: int = 0  # consecutive liveness failures (and failures seen on live traffic)
    probe_fails: int = 0  # consecutive deep-probe failures
    passes: int = 0  # consecutive passing probes while evicted
    evictions: int = 0
    probes: int = 0
    last_error: str = ""
    last_probe_at: float = float("-inf")
    last_probe_ok: bool | None = None
    readmitted_after: int = 0  # passing probes behind the last re-admission

    def fail(self, reason: str, evict_after: int, probe: bool = False) -> bool:
        """Count a failure (`probe`: of the deep probe); True when this one evicts."""
        if probe:
            self.probe_fails += 1
        else:
            self.fails += 1
        self.passes = 0
        self.last_error = reason
        if not self.evicted and max(self.fails, self.probe_fails) >= evict_after:
            self.evicted = True
            self.evictions += 1
            return True
        return False

    def evict(self, reason: str) -> bool:
        """Evict at once (conclusive evidence, e.g. the port refuses connections)."""
        self.passes = 0
        self.last_error = reason
        if self.evicted:
            return False
        self.evicted, self.evictions = True, self.evictions + 1
        return True

    def passed(self, probed: bool, readmit_after: int) -> bool:
        """Count a pass: of liveness, or (`probed`) of the deep probe. True when this one
        re-admits an evicted replica (only passing probes do)."""
        if not probed:
            self.fails = 0
            return False
        self.probe_fails = 0
        if not self.evicted:
            return False
        self.passes += 1
        if self.passes < readmit_after:
            return False
        self.evicted, self.readmitted_after, self.passes = False, self.passes, 0
        return True


class HealthChecker:
    """Runs one check loop per replica in the registry; mirrors the verdict into
    `Replica.evicted` and `Replica.ready` and calls `on_evict` / `on_readmit`."""

    def __init__(self, registry: Registry, cfg: HealthConfig, session: aiohttp.ClientSession,
                 on_evict: Callable[[Replica, str], None],
                 on_readmit: Callable[[Replica], None],
                 stalled: Callable[[str, float], bool] = lambda rid, now: False,
                 clock: Callable[[], float] = time.monotonic, probe_key: str | None = None):
        self.registry = registry
        self.cfg = cfg
        self.session = session
        self.on_evict = on_evict
        self.on_readmit = on_readmit
        self.stalled = stalled
        self.clock = clock
        # A replica's /v1/probe is an operator's tool: it needs its admin or fleet key.
        self.probe_headers = {"Authorization": f"Bearer {probe_key}"} if probe_key else {}
        self.records: dict[str, HealthRecord] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._probing: dict[str, asyncio.Task[None]] = {}
        self._main: asyncio.Task[None] | None = None
        self._unprobed: set[str] = set()
        # Closed: the router is shutting down, and replicas that stop answering are stopping
        # with it (an orderly stop, not a failure worth a warning).
        self.closed = False

    def record(self, replica_id: str) -> HealthRecord:
        rec = self.records.get(replica_id)
        if rec is None:
            rec = self.records[replica_id] = HealthRecord()
        return rec

    def start(self) -> None:
        self._main = asyncio.get_running_loop().create_task(self._supervise())

    async def close(self) -> None:
        self.closed = True
        tasks = [t for t in (self._main, *self._tasks.values(), *self._probing.values())
                 if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def report_failure(self, rep: Replica, reason: str, conclusive: bool = False) -> None:
        """A failure the proxy saw on live traffic (refused connection, reset stream)."""
        rec = self.record(rep.replica_id)
        evicted = rec.evict(reason) if conclusive else rec.fail(reason, self.cfg.evict_after)
        if evicted:
            self._evicted(rep, reason)

    async def _supervise(self) -> None:
        while True:
            for rep in self.registry:
                task = self._tasks.get(rep.replica_id)
                if task is None or task.done():
                    self._tasks[rep.replica_id] = asyncio.get_running_loop().create_task(
                        self._loop(rep.replica_id))
            for rid in self.registry.forget_stale(self.clock()):
                self.forget(rid)
            await asyncio.sleep(self.cfg.interval)

    def forget(self, replica_id: str) -> None:
        """Drop a replica's checks and record, so one that comes back starts clean."""
        for tasks in (self._tasks, self._probing):
            task = tasks.pop(replica_id, None)
            if task is not None:
                task.cancel()
        self.records.pop(replica_id, None)

    async def _loop(self, replica_id: str) -> None:
        while (rep := self.registry.get(replica_id)) is not None:
            started = self.clock()
            try:
                await self.check(rep)
            except Exception:  # a bug in one check must not end the loop
                log.exception("health check of %s failed", replica_id)
            await asyncio.sleep(max(0.0, self.cfg.interval - (self.clock() - started)))

    async def check(self, rep: Replica) -> None:
        """One round: liveness and readiness; starts the deep probe when due. The probe runs
        beside the rounds, so a slow probe never delays the liveness verdict."""
        cfg, rec = self.cfg, self.record(rep.replica_id)
        live, ready = await asyncio.gather(self._liveness(rep), self._readiness(rep))
        if live is not None:
            if rep.state is not None:
                self._fail(rep, rec, live)
            else:  # never answered yet: still starting, not failing (and not routable)
                rec.last_error = live
            return
        if ready is not None:
            rep.ready = ready
        rec.passed(False, cfg.readmit_after)
        now = self.clock()
        since = now - rec.last_probe_at
        due = (rec.evicted or rec.fails > 0 or rec.probe_fails > 0
               or since >= cfg.probe_interval
               or (since >= cfg.stall_after and self.stalled(rep.replica_id, now)))
        running = self._probing.get(rep.replica_id)
        if due and (running is None or running.done()):
            rec.last_probe_at = now
            self._probing[rep.replica_id] = asyncio.get_running_loop().create_task(
                self.deep_probe(rep))

    async def deep_probe(self, rep: Replica) -> None:
        rec = self.record(rep.replica_id)
        error = await self._probe(rep)
        if error is _NOT_ALLOWED:
            if not rec.evicted:
                return
            error = None  # its liveness passed this round: the only evidence this router has
        rec.probes += 1
        rec.last_probe_ok = error is None
        if error is not None:
            self._fail(rep, rec, error, probe=True)
        elif rec.passed(True, self.cfg.readmit_after):
            rep.evicted = False
            log.info("replica %s re-admitted after %d passing probes", rep.replica_id,
                     rec.readmitted_after)
            self.on_readmit(rep)

    def _fail(self, rep: Replica, rec: HealthRecord, reason: str, probe: bool = False) -> None:
        if rec.fail(reason, self.cfg.evict_after, probe):
            self._evicted(rep, reason)

    def _evicted(self, rep: Replica, reason: str) -> None:
        rep.evicted = True
        if self.closed:
            log.info("replica %s stopped with the router: %s", rep.replica_id, reason)
        else:
            log.warning("replica %s evicted: %s", rep.replica_id, reason)
        self.on_evict(rep, reason)

    async def _liveness(self, rep: Replica) -> str | None:
        """None when alive, else why not."""
        try:
            async with self.session.get(rep.url + "/health", timeout=aiohttp.ClientTimeout(
                    total=self.cfg.liveness_timeout)) as resp:
                if resp.status == 200:
                    return None
                return f"/health answered {resp.status}"
        except TimeoutError:
            return f"/health gave no answer within {self.cfg.liveness_timeout:g}s"
        except aiohttp.ClientError as exc:
            return f"/health failed: {type(exc).__name__}"

    async def _readiness(self, rep: Replica) -> bool | None:
        """Ready or not; None when unknown (the liveness check reports the failure)."""
        timeout = aiohttp.ClientTimeout(total=self.cfg.liveness_timeout)
        path = "/ready" if rep.beats else "/v1/state"
        with contextlib.suppress(TimeoutError, aiohttp.ClientError, ValueError):
            async with self.session.get(rep.url + path, timeout=timeout) as resp:
                if rep.beats:
                    return resp.status == 200
                state = orjson.loads(await resp.read())
                return resp.status == 200 and self.registry.observe(
                    rep.replica_id, state, self.clock(), poll=True)
        return None

    async def _probe(self, rep: Replica) -> str | None:
        deadline = self.cfg.probe_deadline
        timeout = aiohttp.ClientTimeout(total=deadline + self.cfg.liveness_timeout)
        try:
            async with self.session.post(f"{rep.url}/v1/probe?timeout={deadline:g}",
                                         headers=self.probe_headers, timeout=timeout) as resp:
                if resp.status == 200:
                    return None
                if resp.status in (401, 429):
                    if resp.status == 401 and rep.replica_id not in self._unprobed:
                        self._unprobed.add(rep.replica_id)
                        log.warning("replica %s refuses this router's deep probes (no shared "
                                    "admin or fleet key); judging it by liveness",
                                    rep.replica_id)
                    return _NOT_ALLOWED
                body = await resp.read()
                return f"probe answered {resp.status}: {body[:200].decode(errors='replace')}"
        except TimeoutError:
            return f"probe gave no answer within {deadline:g}s"
        except aiohttp.ClientError as exc:
            return f"probe failed: {type(exc).__name__}"
