"""Routing policies for the simulator behind one small protocol, so the fleet router's own policy
can be plugged in next to them.

A policy sees `ReplicaView`s (what the router believes about each routable replica: the
`/v1/state` numbers from the last heartbeat, minus what it has sent since, and the router's own
in-flight accounting and measured rates) and a `RouteRequest`,
and returns the position of its choice in the views (None: no candidate). A policy with
`live = True` is handed the replicas themselves (perfect, zero-delay knowledge: the oracle).

- `RoundRobin`, `RandomChoice`: ignore state.
- `LeastLoaded` (live): fewest waiting, then most free KV after this request (the simulator's
  first yardstick; kept for comparison).
- `Oracle` (live): least predicted time to first token over every replica, with the fleet
  router's own `wait_parts` fed exact numbers: the prefill tokens really queued, the true
  rates of each replica, what is left of a stall; and the router's own choice among the scores
  (`pick_scored`: a request late everywhere is packed where it delays no in-time request). No
  sampling, no staleness, no estimates.
- `PowerOfTwoFreeKV`: sample two, keep the one with more free KV after reserving this request,
  fewer waiting breaking ties.
- `FleetPolicyAdapter`: wraps a fleet-style `choose(cands, tokens, key, cfg, rng, weights,
  exclude) -> candidate | None` with a candidate constructor, so `batcher.fleet.router.policy`'s
  policy runs here (`make_policy("fleet")` imports it only when asked).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class ReplicaView(Protocol):
    """One replica as a policy sees it (names follow `/v1/state`)."""

    @property
    def index(self) -> int: ...
    @property
    def replica_id(self) -> str: ...
    @property
    def zone(self) -> int: ...
    @property
    def free_blocks(self) -> int: ...
    @property
    def total_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def fresh(self) -> bool: ...  # the last beat is recent enough to trust
    @property
    def age(self) -> float: ...  # seconds since the state was measured
    @property
    def inflight(self) -> int: ...  # the router's own requests there
    @property
    def others(self) -> int: ...  # reported sequences beyond the router's own
    @property
    def prefill_tokens(self) -> int: ...  # prompt tokens of those without a first token
    @property
    def overdue_s(self) -> float: ...  # how late the oldest of those is
    @property
    def prefill_rate(self) -> float | None: ...  # measured prompt tokens/s to first token
    @property
    def step_s(self) -> float | None: ...  # measured decode step seconds


@dataclass(slots=True)
class RouteRequest:
    """What the router knows of a request: its size, its prompt's leading tokens (for prefix
    affinity) and the replicas it already tried (by `ReplicaView.index`)."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    prefix: Sequence[int] = ()
    tried: frozenset[int] = field(default_factory=frozenset)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


class RoutingPolicy(Protocol):
    name: str
    live: bool

    def choose(self, views: Sequence[ReplicaView], req: RouteRequest) -> int | None: ...


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // max(1, block_size))


def _untried(views: Sequence[ReplicaView], req: RouteRequest) -> list[int]:
    if not req.tried:
        return list(range(len(views)))
    return [i for i, v in enumerate(views) if v.index not in req.tried]


class RoundRobin:
    name = "round-robin"
    live = False

    def __init__(self, seed: int = 0) -> None:
        self._next = seed

    def choose(self, views: Sequence[ReplicaView], req: RouteRequest) -> int | None:
        n = len(views)
        for k in range(n):
            i = (self._next + k) % n
            if views[i].index not in req.tried:
                self._next = i + 1
                return i
        return None


class RandomChoice:
    name = "random"
    live = False

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def choose(self, views: Sequence[ReplicaView], req: RouteRequest) -> int | None:
        if not req.tried:
            return self.rng.randrange(len(views)) if views else None
        pool = _untried(views, req)
        return self.rng.choice(pool) if pool else None


class LeastLoaded:
    name = "least-loaded (oracle)"
    live = True

    def __init__(self, seed: int = 0) -> None:
        del seed

    def choose(self, views: Sequence[ReplicaView], req: RouteRequest) -> int | None:
        best, best_key = None, None
        tokens = req.tokens
        for i, v in enumerate(views):
            if v.index in req.tried:
                continue
            key = (v.waiting, _blocks(tokens, v.block_size) - v.free_blocks)
            if best_key is None or key < best_key:
                best, best_key = i, key
        return best


class Oracle:
    """Least predicted TTFT from live state (`views` are `LiveView`s), chosen among as the
    router's policy chooses (`pick_scored`)."""

    name = "oracle"
    live = True

    def __init__(self, seed: int = 0, cfg: Any = None) -> None:
        from batcher.fleet.router import policy
        self.rng = random.Random(seed)
        self._policy = policy
        self.cfg = cfg or policy.PolicyConfig().validate()

    def choose(self, views: Sequence[ReplicaView], req: RouteRequest) -> int | None:
        pol, cfg = self._policy, self.cfg
        cands = [(i, _candidate(pol.Candidate, v)) for i, v in enumerate(views)
                 if v.index not in req.tried]
        fit = [(i, c) for i, c in cands if pol.fits(c, req.tokens)] or cands
        if not fit:
            return None
        priors = pol.Priors(cfg.prefill_rate_prior, cfg.step_s_prior)
        scored = [(c, *pol.wait_parts(c, req.prompt_tokens, req.tokens, cfg, priors))
                  for _, c in fit]
        pick = pol.pick_scored(scored, None, cfg, self.rng)
        return next(i for i, c in fit if c is pick)


def _candidate(make: Callable[..., Any], v: Any, version: str = "v1") -> Any:
    """A fleet `Candidate` from a simulator view (router view or live view)."""
    return make(replica_id=v.replica_id, free_blocks=v.free_blocks,
                total_blocks=v.total_blocks, block_size=v.block_size, waiting=v.waiting,
                version=version, fresh=v.fresh, running=v.running, inflight=v.inflight, others=v.others,
                prefill_tokens=v.prefill_tokens, overdue_s=v.overdue_s,
                prefill_rate=v.prefill_rate, step_s=v.step_s)


class PowerOfTwoFreeKV:
    name = "power-of-two by free KV"
    live = False

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def choose(self, views: Sequence[ReplicaView], req: RouteRequest) -> int | None:
        n = len(views)
        if req.tried:
            pool = _untried(views, req)
            if len(pool) < 2:
                return pool[0] if pool else None
            i, j = self.rng.sample(pool, 2)
        elif n < 2:
            return 0 if n else None
        else:
            i = self.rng.randrange(n)
            j = self.rng.randrange(n - 1)
            j += j >= i
        a, b = views[i], views[j]
        fa = a.free_blocks - _blocks(req.tokens, a.block_size)
        fb = b.free_blocks - _blocks(req.tokens, b.block_size)
        if fa != fb:
            return i if fa > fb else j
        return i if a.waiting <= b.waiting else j


class FleetPolicyAdapter:
    """A fleet router's `choose` as a `RoutingPolicy`.

    `choose_fn(cands, tokens, key, cfg, rng, weights, exclude, prompt_tokens=)` picks among
    candidates built by `make_candidate(replica_id=, free_blocks=, total_blocks=, block_size=,
    waiting=, version=, fresh=, running=, inflight=, prefill_tokens=, overdue_s=,
    prefill_rate=, step_s=)` and returns one of them (or None). `key` is the affinity key the router would hash:
    for a token-id prompt, the leading `key_tokens` ids joined by commas (None when the prompt is
    shorter than `min_key_tokens`).
    """

    live = False
    wants_prefix = True  # the simulator fills `RouteRequest.prefix` for this policy

    def __init__(self, choose_fn: Callable[..., Any], make_candidate: Callable[..., Any],
                 cfg: Any, seed: int = 0, name: str = "fleet router policy",
                 key_tokens: int = 64, min_key_tokens: int = 16, version: str = "v1") -> None:
        self.name = name
        self.choose_fn = choose_fn
        self.make_candidate = make_candidate
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.key_tokens = key_tokens
        self.min_key_tokens = min_key_tokens
        self.version = version

    def choose(self, views: Sequence[ReplicaView], req: RouteRequest) -> int | None:
        pos = {v.replica_id: i for i, v in enumerate(views)}
        cands = [_candidate(self.make_candidate, v, self.version) for v in views]
        key = None
        if self.key_tokens > 0 and len(req.prefix) >= self.min_key_tokens:
            key = ",".join(map(str, req.prefix[: self.key_tokens]))
        exclude = {views[i].replica_id for i in range(len(views)) if views[i].index in req.tried}
        c = self.choose_fn(cands, req.tokens, key, self.cfg, self.rng, None, exclude,
                           prompt_tokens=req.prompt_tokens)
        return None if c is None else pos[c.replica_id]


POLICIES: dict[str, type] = {"round-robin": RoundRobin, "random": RandomChoice,
                             "least-loaded": LeastLoaded, "oracle": Oracle,
                             "p2c-kv": PowerOfTwoFreeKV}


def make_policy(name: str, seed: int = 0, slo_ttft_s: float | None = None) -> RoutingPolicy:
    """A policy by its CLI name: one of POLICIES, or `fleet` (the fleet router's own policy
    with its default configuration, through `FleetPolicyAdapter`). `slo_ttft_s` is the
    first-token objective the fleet policy and the oracle route for (default: the router's)."""
    if name in ("fleet", "oracle"):
        from batcher.fleet.router import policy as router
        cfg = router.PolicyConfig()
        if slo_ttft_s is not None:
            cfg.slo_ttft_s = slo_ttft_s
        cfg.validate()
        if name == "oracle":
            return Oracle(seed, cfg)
        # the router hashes leading characters; a token is about `chars_per_token` of them
        return FleetPolicyAdapter(router.choose, router.Candidate, cfg, seed,
                                  key_tokens=int(cfg.affinity_chars / cfg.chars_per_token),
                                  min_key_tokens=int(cfg.affinity_min_chars / cfg.chars_per_token))
    try:
        return POLICIES[name](seed)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {[*sorted(POLICIES), 'fleet']}"
                         ) from None
