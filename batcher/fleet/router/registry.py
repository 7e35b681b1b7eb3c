"""Soft state per replica, fed by heartbeats, piggybacked `X-Replica-State` headers and polls.

Contract (no I/O; every method takes `now`, the router's own monotonic clock):
- `beat(payload, now, trusted)` keeps the newest `(epoch, seq)` per replica and ignores older or
  replayed beats. Integer epochs (boot time) are ordered; any other epoch is a new start when it
  was not seen before for that replica.
- A replica id is bound to the URL it first announced (or was configured with): a beat that
  would move a live replica to another URL raises `BeatRefused` and changes nothing. Only a
  replica that stopped beating (suspect) or was evicted may come back at a new URL, and never a
  configured one. New ids beyond `max_replicas` are refused; known replicas are never displaced.
- An `admin_url` is taken only from a `trusted` beat (one that carried the fleet key): the
  router sends the replicas' admin key there.
- A replica is *suspect* when its last beat is older than `suspect_beats * beat_interval`. A
  replica that never heartbeats (added with `--replica URL`) is kept fresh by the health
  checker's `/v1/state` polls instead (`poll=True`).
- `observe(...)` (piggyback) refreshes the capacity numbers but never the beat clock.
- The router's own reservations made after the last state snapshot are subtracted from the
  replica's free blocks (`effective_free`) and added to its queue (`effective_waiting`), so
  stale data cannot make one replica look emptier than it is.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from batcher.engine.snapshot import EngineSnapshot

_RETIRED_EPOCHS = 8  # string epochs remembered per replica, so a replayed old start is refused
MAX_REPLICAS = 256


class BeatRefused(Exception):
    """A well-formed beat the registry will not apply (`status`: the HTTP answer)."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class Reservation:
    blocks: int
    at: float


@dataclass(slots=True)
class Replica:
    """One replica as the router sees it. `ready` and `evicted` are set by the health checker,
    `router_draining` by the rollout API. A replica that registered itself by heartbeat (or
    moved to a new URL) is not ready until this router has reached it there: a keyed beat that
    names an address the router cannot reach must not draw traffic meanwhile."""

    replica_id: str
    url: str
    admin_url: str | None = None
    state: EngineSnapshot | None = None
    state_at: float = float("-inf")
    beat_at: float | None = None
    epoch: int | str | None = None
    seq: int = -1
    beats: bool = False  # has sent at least one heartbeat
    static: bool = False  # configured, never forgotten
    ready: bool = True
    evicted: bool = False
    router_draining: bool = False
    reservations: dict[int, Reservation] = field(default_factory=dict)
    # what the reservations since `state_at` add up to, kept as they change (a pick reads every
    # replica's; recounting each replica's reservations made a pick grow with the work in flight)
    unreflected_count: int = 0
    unreflected_blocks: int = 0
    retired_epochs: list[str] = field(default_factory=list)

    @property
    def version(self) -> str | None:
        return self.state.version if self.state is not None else None

    @property
    def inflight(self) -> int:
        return len(self.reservations)

    def unreflected(self) -> list[Reservation]:
        """Reservations the last state snapshot cannot include yet."""
        return [r for r in self.reservations.values() if r.at >= self.state_at]

    def set_state(self, state: EngineSnapshot, at: float) -> None:
        self.state, self.state_at = state, at
        mine = self.unreflected()
        self.unreflected_count, self.unreflected_blocks = len(mine), sum(r.blocks for r in mine)


def replica_id_for(url: str) -> str:
    """The default id of a replica at `url`: `host:port`, the same as `batcher serve` uses."""
    parts = urlsplit(url)
    return parts.netloc or url


class Registry:
    """All replicas known to one router."""

    def __init__(self, beat_interval: float = 1.0, suspect_beats: float = 3.0,
                 forget_after: float = 60.0, max_replicas: int = MAX_REPLICAS):
        self.beat_interval = beat_interval
        self.suspect_after = beat_interval * suspect_beats
        self.forget_after = forget_after
        self.max_replicas = max_replicas
        self.replicas: dict[str, Replica] = {}
        self._tokens = itertools.count(1)
        # Told each time a replica's state changes (the router's load account reads it then).
        self.on_state: Callable[[Replica], None] | None = None
        # Told the id of each replica forgotten (its metric series go with it).
        self.on_forget: Callable[[str], None] | None = None

    def __iter__(self) -> Iterator[Replica]:
        return iter(list(self.replicas.values()))

    def __len__(self) -> int:
        return len(self.replicas)

    def get(self, replica_id: str) -> Replica | None:
        return self.replicas.get(replica_id)

    # membership ------------------------------------------------------------------------------
    def add_static(self, url: str, replica_id: str | None = None,
                   admin_url: str | None = None) -> Replica:
        rid = replica_id or replica_id_for(url)
        rep = self.replicas.get(rid)
        if rep is None:
            rep = self.replicas[rid] = Replica(rid, url.rstrip("/"))
        rep.static = True
        rep.admin_url = admin_url.rstrip("/") if admin_url else rep.admin_url
        return rep

    def remove(self, replica_id: str) -> Replica | None:
        """Forget one replica now (discovery, once its address is gone and its work is done)."""
        rep = self.replicas.pop(replica_id, None)
        if rep is not None and self.on_forget is not None:
            self.on_forget(replica_id)
        return rep

    def forget_stale(self, now: float) -> list[str]:
        """Drop dynamic replicas that stopped beating long ago and are evicted."""
        gone = [r.replica_id for r in self.replicas.values()
                if not r.static and r.evicted and r.beat_at is not None
                and now - r.beat_at > self.forget_after and not r.reservations]
        for rid in gone:
            self.remove(rid)  # one way out, so what a subclass or listener keeps goes too
        return gone

    # state updates ---------------------------------------------------------------------------
    def beat(self, payload: Mapping[str, Any], now: float, trusted: bool = False) -> bool:
        """Apply a heartbeat. Returns False when it is older than one already applied (or
        replayed). ValueError when the payload is malformed; BeatRefused when it would repoint
        a live replica or register one past the cap."""
        rid, url = payload.get("replica_id"), payload.get("url")
        epoch, seq = payload.get("epoch"), payload.get("seq")
        if not isinstance(rid, str) or not rid or not isinstance(url, str) or not url:
            raise ValueError("a heartbeat needs 'replica_id' and 'url' strings")
        if len(rid) > 128 or len(url) > 2048:
            raise ValueError("'replica_id' or 'url' is too long")
        if isinstance(epoch, bool) or not isinstance(epoch, (int, str)) or (
                isinstance(seq, bool) or not isinstance(seq, int)):
            raise ValueError(  # noqa: TRY004 (the caller answers 400 to any ValueError)
                "a heartbeat needs an 'epoch' (int or str) and an int 'seq'")
        state = EngineSnapshot.from_wire(payload)
        url = url.rstrip("/")
        rep = self.replicas.get(rid)
        if rep is None:
            if len(self.replicas) >= self.max_replicas:
                raise BeatRefused(f"the router holds {self.max_replicas} replicas already", 503)
            rep = self.replicas[rid] = Replica(rid, url, ready=False)
        if not self._newer(rep, epoch, seq):
            return False
        if url != rep.url:
            self._check_move(rep, epoch, now)
        if rep.epoch is not None and rep.epoch != epoch and isinstance(rep.epoch, str):
            rep.retired_epochs = [*rep.retired_epochs, rep.epoch][-_RETIRED_EPOCHS:]
        rep.epoch, rep.seq, rep.beats = epoch, seq, True
        rep.url = url
        admin_url = payload.get("admin_url")
        if trusted and isinstance(admin_url, str) and admin_url and not (
                rep.static and rep.admin_url):
            rep.admin_url = admin_url.rstrip("/")
        rep.beat_at = now
        self._set_state(rep, state, now)
        return True

    def _check_move(self, rep: Replica, epoch: int | str, now: float) -> None:
        """A beat names another URL than the one `rep` is bound to: allowed only for a new
        start of a dynamic replica that is no longer live (it moved)."""
        if rep.static:
            raise BeatRefused(f"replica {rep.replica_id!r} is configured at another URL")
        if epoch == rep.epoch:
            raise BeatRefused(f"replica {rep.replica_id!r} cannot change its URL mid-run")
        if not rep.evicted and not self.suspect(rep, now):
            raise BeatRefused(f"replica {rep.replica_id!r} is live at another URL")
        rep.admin_url = None  # announced for the old address; the new one must announce again
        rep.ready = False  # until the router has reached the new address

    @staticmethod
    def _newer(rep: Replica, epoch: int | str, seq: int) -> bool:
        if rep.epoch is None:
            return True
        if epoch == rep.epoch:
            return seq > rep.seq
        if isinstance(epoch, int) and isinstance(rep.epoch, int):
            return epoch > rep.epoch
        return isinstance(epoch, str) and epoch not in rep.retired_epochs

    def observe(self, replica_id: str, state: Mapping[str, Any] | EngineSnapshot, now: float,
                poll: bool = False) -> bool:
        """A state seen on a response (piggyback) or fetched by a poll. A poll counts as a
        beat only for replicas that never heartbeat. Returns False when unusable."""
        rep = self.replicas.get(replica_id)
        if rep is None:
            return False
        try:
            st = state if isinstance(state, EngineSnapshot) else EngineSnapshot.from_wire(state)
        except ValueError:
            return False
        if now < rep.state_at:
            return False
        if poll and not rep.beats:
            rep.beat_at = now
        self._set_state(rep, st, now)
        return True

    def _set_state(self, rep: Replica, state: EngineSnapshot, now: float) -> None:
        rep.set_state(state, now)
        if self.on_state is not None:
            self.on_state(rep)

    # judgements ------------------------------------------------------------------------------
    def suspect(self, rep: Replica, now: float) -> bool:
        """No beat (or poll, for non-beating replicas) within `suspect_after`."""
        return rep.beat_at is None or now - rep.beat_at > self.suspect_after

    @staticmethod
    def trusted(rep: Replica) -> bool:
        """Healthy, ready and not evicted, by every source the router has: a replica the router
        may send a tenant's key to. Draining or not: one that drains still holds its files."""
        st = rep.state
        return st is not None and st.healthy and rep.ready and not rep.evicted

    @staticmethod
    def routable(rep: Replica) -> bool:
        """Trusted and not draining: a replica that takes new work."""
        st = rep.state
        return (Registry.trusted(rep) and st is not None and not st.draining
                and not rep.router_draining)

    @staticmethod
    def effective_free(rep: Replica) -> int:
        st = rep.state
        if st is None:
            return 0
        return st.free_blocks - rep.unreflected_blocks

    @staticmethod
    def effective_waiting(rep: Replica) -> int:
        st = rep.state
        return (st.waiting if st is not None else 0) + rep.unreflected_count

    # the router's own in-flight work ----------------------------------------------------------
    def reserve(self, rep: Replica, blocks: int, now: float) -> int:
        token = next(self._tokens)
        rep.reservations[token] = Reservation(blocks, now)
        if now >= rep.state_at:
            rep.unreflected_count += 1
            rep.unreflected_blocks += blocks
        return token

    def release(self, rep: Replica, token: int) -> None:
        r = rep.reservations.pop(token, None)
        if r is not None and r.at >= rep.state_at:
            rep.unreflected_count -= 1
            rep.unreflected_blocks -= r.blocks

    def snapshot(self, now: float) -> list[dict[str, Any]]:
        """JSON-ready view for /v1/state and the admin status."""
        out = []
        for r in self.replicas.values():
            st = r.state
            out.append({
                "replica_id": r.replica_id, "url": r.url, "version": r.version,
                "routable": self.routable(r), "suspect": self.suspect(r, now),
                "evicted": r.evicted, "ready": r.ready, "router_draining": r.router_draining,
                "draining": st.draining if st else None, "healthy": st.healthy if st else None,
                "free_blocks": st.free_blocks if st else None,
                "total_blocks": st.total_blocks if st else None,
                "running": st.running if st else None, "waiting": st.waiting if st else None,
                "router_inflight": r.inflight, "epoch": r.epoch, "seq": r.seq,
                "beat_age": None if r.beat_at is None else round(now - r.beat_at, 3),
                "state_age": None if st is None else round(now - r.state_at, 3)})
        return out
