"""The fleet routing policy: pure functions and small classes, no I/O and no clock of their own,
so the router and the simulator share them.

- `predicted_wait(c, prompt, tokens, ...)`: the seconds a new request would wait for its first
  token on a candidate: the prefill work ahead of it (the router's own outstanding prompt tokens
  there, plus what the replica reports beyond the router's own requests) and its own prompt, at
  the replica's measured prefill rate slowed by the sequences it runs, plus one step, plus
  however late the oldest request there still without a first token is (a stalled replica shows
  up at once). KV is a fit constraint; it adds to the wait only when scarce (below
  `hot_headroom` free after this request), because a replica short of blocks preempts.
- `choose(...)`: candidates are the routable replicas of the version the rollout weights pick;
  fresh (non-suspect) replicas are preferred over suspect ones, and those that can hold the
  request over those that cannot. The lowest predicted wait wins. A rendezvous hash of the
  prompt's leading text names a preferred replica (its prefix cache is warm); it wins while its
  predicted wait is at most `affinity_max_extra_s` above the best. A request that misses the
  first-token objective (`slo_ttft_s`) on every replica is packed onto the busiest replica too
  slow for it anyway, within `late_extra_s` of the best wait (`pick_scored`), so the fleet's
  other queues stay short enough for requests that can still meet it.
- `choose_round_robin(...)`: the naive baseline, for comparison.
- `pick_version(weights, available, r)`: weighted version choice; `"*"` stands for every
  version not named.

What it reads of a request (its token estimates, its affinity key) is `request_estimates.py`;
retries and their backoff are `retry_budget.py`.

Why every candidate and not two sampled ones: the router's own accounting is exact and updated
the moment it sends, so scoring all of them does not herd the way stale state would, and with
long prompts a replica already prefilling doubles the next one's time to first token: two random
picks are both busy often enough to lose to round-robin (`docs/capacity.md`). Scoring is about a
microsecond per candidate (`wait_parts`: no allocation but its result); at 256 replicas building
the candidates from the registry costs more than scoring them (`python -m scripts.bench router`), so
sampling (`choices`, for pools over `sample_above`) saves little and is off by default.

Why not free KV or `waiting` alone: while KV is abundant free blocks barely differ between
replicas, and chunked prefill admits requests at once so `waiting` stays 0 until a replica is
saturated; with long prompts the time to first token is set by the prefill tokens queued ahead,
which neither number shows.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

OTHERS = "*"
POLICIES = ("predicted-wait", "round-robin")  # the router's --policy names
_TIE_S = 1e-6  # predicted waits closer than this are equal
_M64 = (1 << 64) - 1


@dataclass(slots=True)
class PolicyConfig:
    affinity_chars: int = 256  # leading prompt characters hashed for prefix affinity; 0 = off
    affinity_min_chars: int = 64  # shorter prompts have no prefix worth steering for
    hot_headroom: float = 0.1  # KV is scarce below this share free after the request
    affinity_max_extra_s: float = 0.05  # predicted wait a prefix-cache hit may cost at most
    prefill_rate_prior: float = 2000.0  # prompt tokens/s assumed until a replica is measured
    step_s_prior: float = 0.05  # decode step seconds assumed until a replica is measured
    choices: int = 0  # candidates scored in a pool over `sample_above`; 0 = every one
    sample_above: int = 64  # pools up to this size are always scored whole
    slo_ttft_s: float = 1.0  # the first-token objective; 0 = least predicted wait only
    late_extra_s: float = 10.0  # extra wait a request that misses the objective anyway may get
    seqs_per_step: float = 8.0  # running sequences that double the time a prefill takes
    kv_scarce_s: float = 2.0  # wait added as free KV after the request goes headroom -> 0
    chars_per_token: float = 4.0
    default_max_tokens: int = 16  # completions' default when the client sends none
    default_chat_max_tokens: int = 256  # an estimate; the replica fills its own default

    def validate(self) -> PolicyConfig:
        if self.affinity_chars < 0 or self.affinity_min_chars < 0:
            raise ValueError("affinity lengths must be >= 0")
        if not 0.0 <= self.hot_headroom < 1.0:
            raise ValueError("hot_headroom must be in [0, 1)")
        if min(self.affinity_max_extra_s, self.kv_scarce_s, self.slo_ttft_s,
               self.late_extra_s) < 0:
            raise ValueError("affinity_max_extra_s, kv_scarce_s, slo_ttft_s and late_extra_s "
                             "must be >= 0")
        if self.choices < 0 or self.choices == 1 or self.sample_above < 0:
            raise ValueError("choices must be 0 (all) or >= 2, sample_above >= 0")
        if min(self.prefill_rate_prior, self.step_s_prior, self.seqs_per_step) <= 0:
            raise ValueError("rate and step priors and seqs_per_step must be > 0")
        if self.chars_per_token <= 0:
            raise ValueError("chars_per_token must be > 0")
        return self


@dataclass(slots=True)
class Candidate:
    """A routable replica as the policy sees it. `free_blocks` and `waiting` are the last
    reported state with the router's own unreflected requests applied; the rest is what the
    router knows exactly (what it sent there and has not seen finish) or measured itself."""

    replica_id: str
    free_blocks: int
    total_blocks: int
    block_size: int
    waiting: int
    version: str
    fresh: bool = True
    running: int = 0  # reported
    inflight: int = 0  # the router's own requests there
    others: int = 0  # reported sequences beyond the router's own that the report could show
    prefill_tokens: int = 0  # prompt tokens of those still without a first token
    overdue_s: float = 0.0  # how much longer than predicted the oldest of those has waited
    prefill_rate: float | None = None  # measured prompt tokens/s to first token; None: unknown
    step_s: float | None = None  # measured seconds per decode step; None: unknown


def rendezvous_weight(key: str, replica_id: str) -> int:
    """The weight of `replica_id` for `key`; the highest weight is the key's preferred
    replica. Stable across processes, so every router prefers the same one."""
    return _mix(_digest(key) ^ _digest(replica_id))


@functools.lru_cache(maxsize=4096)
def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _mix(x: int) -> int:
    """A 64-bit finalizer (splitmix64's): every input bit moves every output bit, so one key's
    ranking of replicas is unrelated to another's. NOTE: digests are hashed once each and
    mixed per replica, so ranking a large fleet costs no hash per replica."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // max(1, block_size))


def fits(c: Candidate, tokens: int) -> bool:
    """The replica can hold the request's whole KV need now (the replica checks again)."""
    return c.free_blocks >= blocks_for(tokens, c.block_size)


@dataclass(slots=True, frozen=True)
class Priors:
    """What to assume for replicas the router has not measured yet: the fleet's mean."""

    prefill_rate: float
    step_s: float

    @classmethod
    def of(cls, cands: Sequence[Candidate], cfg: PolicyConfig) -> Priors:
        rates = [c.prefill_rate for c in cands if c.prefill_rate]
        steps = [c.step_s for c in cands if c.step_s]
        return cls(sum(rates) / len(rates) if rates else cfg.prefill_rate_prior,
                   sum(steps) / len(steps) if steps else cfg.step_s_prior)


def predicted_wait(c: Candidate, prompt_tokens: int, tokens: int, cfg: PolicyConfig,
                   priors: Priors) -> float:
    """Seconds until a new request of `prompt_tokens` (`tokens` with its output) would see its
    first token on `c`."""
    queue, own = wait_parts(c, prompt_tokens, tokens, cfg, priors)
    return queue + own


def wait_parts(c: Candidate, prompt_tokens: int, tokens: int, cfg: PolicyConfig,
               priors: Priors) -> tuple[float, float]:
    """`predicted_wait` as (the wait of the work ahead, this request's own prefill): the
    first part is what any request sent there now would wait before its own prompt."""
    rate = c.prefill_rate or priors.prefill_rate
    # Running sequences take their decode rows out of every step's token budget first, so
    # they slow the prefill ahead and the new request's own.
    per_token = (1.0 + (c.inflight + c.others) / cfg.seqs_per_step) / rate
    # The router's own count is exact for what it sent; what the replica reports beyond it
    # (`others`) is other routers' work, of unknown size: assume this request's.
    others = min(c.waiting, c.others)
    queue = ((c.prefill_tokens + others * prompt_tokens) * per_token
             + (c.step_s or priors.step_s) + c.overdue_s)
    if c.total_blocks > 0 and cfg.hot_headroom > 0:
        left = (c.free_blocks - blocks_for(tokens, c.block_size)) / c.total_blocks
        if left < cfg.hot_headroom:
            queue += cfg.kv_scarce_s * min(1.0, (cfg.hot_headroom - left) / cfg.hot_headroom)
    return queue, prompt_tokens * per_token


def choose(cands: Sequence[Candidate], tokens: int, key: str | None, cfg: PolicyConfig,
           rng: random.Random, weights: Mapping[str, float] | None = None,
           exclude: frozenset[str] | set[str] = frozenset(),
           prompt_tokens: int | None = None) -> Candidate | None:
    """The replica for one request (None when there is none). `tokens` is its whole KV need,
    `prompt_tokens` its prefill (default: `tokens`); `exclude` names replicas this request
    already tried."""
    pool = [c for c in cands if c.replica_id not in exclude] if exclude else list(cands)
    if weights:
        version = pick_version(weights, {c.version for c in pool}, rng.random())
        pool = [c for c in pool if c.version == version]
    if not all(c.fresh for c in pool):
        pool = [c for c in pool if c.fresh] or pool
    need = {c.block_size: blocks_for(tokens, c.block_size) for c in pool}
    if not all(c.free_blocks >= need[c.block_size] for c in pool):
        pool = [c for c in pool if c.free_blocks >= need[c.block_size]] or pool
    if len(pool) <= 1:
        return pool[0] if pool else None
    prompt = tokens if prompt_tokens is None else prompt_tokens
    priors = Priors.of(pool, cfg)
    preferred = None if key is None else _preferred(pool, key)
    if 0 < cfg.choices < len(pool) and len(pool) > cfg.sample_above:
        sample = rng.sample(pool, cfg.choices)
        if preferred is not None and all(c is not preferred for c in sample):
            sample.append(preferred)
        pool = sample
    scored = [(c, *wait_parts(c, prompt, tokens, cfg, priors)) for c in pool]
    return pick_scored(scored, preferred, cfg, rng)


def pick_scored(scored: Sequence[tuple[Candidate, float, float]], preferred: Candidate | None,
                cfg: PolicyConfig, rng: random.Random) -> Candidate:
    """The choice among scored candidates `(candidate, queue_s, own_s)` (`wait_parts`).

    The least predicted wait wins, and the affinity target while it is at most
    `affinity_max_extra_s` above it. A request that misses `slo_ttft_s` everywhere, even
    on the optimistic reading (every wait without the slowdown of the sequences running
    there, which overstates a busy replica's wait), goes instead where it costs in-time
    requests nothing: among the replicas where its own prefill alone takes longer than the
    objective (as loaded now, nothing its size meets the objective there), not late on what
    they have and within `late_extra_s` of the least wait, the busiest. Spreading such
    requests evenly puts every replica a little past the objective; packing them leaves the
    others' queues short enough for requests that can still meet it. `late_extra_s` bounds
    what this costs the request itself.
    """
    wbest = min(q + o for _, q, o in scored)
    slo = cfg.slo_ttft_s
    if slo > 0 and wbest > slo and min(
            (q + o) / (1.0 + (c.inflight + c.others) / cfg.seqs_per_step)  # optimistic
            for c, q, o in scored) > slo:
        bound = wbest + cfg.late_extra_s
        late = [(c, q + o) for c, q, o in scored
                if o > slo and q + o <= bound and not c.overdue_s]
        if late:
            return max(late, key=lambda x: x[1])[0]
    if preferred is not None:
        for c, q, o in scored:
            if c is preferred:
                if q + o <= wbest + cfg.affinity_max_extra_s:
                    return preferred
                break
    # NOTE: ties (an idle fleet) go to the most free KV, then at random, so several routers
    # starting together do not all pick the same replica.
    best = [c for c, q, o in scored if q + o <= wbest + _TIE_S]
    if len(best) == 1:
        return best[0]
    most = max(c.free_blocks for c in best)
    best = [c for c in best if c.free_blocks == most]
    return best[0] if len(best) == 1 else rng.choice(best)


def choose_round_robin(cands: Sequence[Candidate], turn: int, rng: random.Random,
                       weights: Mapping[str, float] | None = None,
                       exclude: frozenset[str] | set[str] = frozenset()) -> Candidate | None:
    """Naive routing for comparison (`--policy round-robin`): the `turn`-th candidate in id
    order, among those of the weighted version not yet tried. No state, no scores."""
    pool = sorted((c for c in cands if c.replica_id not in exclude), key=lambda c: c.replica_id)
    if weights:
        version = pick_version(weights, {c.version for c in pool}, rng.random())
        pool = [c for c in pool if c.version == version]
    return pool[turn % len(pool)] if pool else None


def _preferred(pool: Sequence[Candidate], key: str) -> Candidate:
    k = _digest(key)
    return max(pool, key=lambda c: _mix(k ^ _digest(c.replica_id)))


def pick_version(weights: Mapping[str, float], available: set[str], r: float) -> str | None:
    """A version drawn by weight among `available` (`r` uniform in [0, 1)). `"*"` gives its
    weight to every available version not named, shared equally. None when no available
    version has weight."""
    named = {v: w for v, w in weights.items() if v != OTHERS and v in available and w > 0}
    rest = [v for v in sorted(available) if v not in weights]
    share = weights.get(OTHERS, 0.0)
    table = list(named.items())
    if rest and share > 0:
        table += [(v, share / len(rest)) for v in rest]
    total = sum(w for _, w in table)
    if total <= 0:
        return None
    x = r * total
    for v, w in table:
        x -= w
        if x < 0:
            return v
    return table[-1][0]
