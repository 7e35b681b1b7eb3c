"""The fleet routing policy: pure functions and small classes, no I/O and no clock of their own, so the
router and the simulator share them.

- `estimate_tokens(body, chat)`: prompt characters / 4 (or the token count of a token-id prompt)
  plus `max_tokens`, times `n`.
- `choose(...)`: candidates are the routable replicas of the version the rollout weights pick;
  fresh (non-suspect) replicas are preferred over suspect ones. A rendezvous hash of the prompt's
  leading text names a preferred replica, used unless it is hot (a queue, or less than
  `hot_headroom` of its KV free after reserving this request). Otherwise power of two choices:
  sample two, keep the one with more free blocks after the reservation, fewer waiting breaking
  ties.
- `pick_version(weights, available, r)`: weighted version choice; `"*"` stands for every
  version not named.
- `RetryBudget`: retries <= max(floor, ratio * requests seen in the window, or in flight).
- `backoff(...)`: full jitter.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

OTHERS = "*"


@dataclass(slots=True)
class PolicyConfig:
    affinity_chars: int = 256  # leading prompt characters hashed for prefix affinity; 0 = off
    affinity_min_chars: int = 64  # shorter prompts have no prefix worth steering for
    hot_headroom: float = 0.1  # the preferred replica is hot below this share of free KV
    chars_per_token: float = 4.0
    default_max_tokens: int = 16  # completions' default when the client sends none
    default_chat_max_tokens: int = 256  # an estimate; the replica fills its own default

    def validate(self) -> PolicyConfig:
        if self.affinity_chars < 0 or self.affinity_min_chars < 0:
            raise ValueError("affinity lengths must be >= 0")
        if not 0.0 <= self.hot_headroom < 1.0:
            raise ValueError("hot_headroom must be in [0, 1)")
        if self.chars_per_token <= 0:
            raise ValueError("chars_per_token must be > 0")
        return self


@dataclass(slots=True, frozen=True)
class Candidate:
    """A routable replica as the policy sees it (effective numbers include reservations)."""

    replica_id: str
    free_blocks: int
    total_blocks: int
    block_size: int
    waiting: int
    version: str
    fresh: bool = True


def estimate_tokens(body: Mapping[str, Any], chat: bool, cfg: PolicyConfig) -> int:
    """Prompt + output tokens one request may hold in KV (an estimate, never below 1)."""
    prompt = 0.0
    if chat:
        for m in body.get("messages") or ():
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            prompt += len(content) / cfg.chars_per_token + 4 if isinstance(content, str) else 4
        default = cfg.default_chat_max_tokens
        out = body.get("max_completion_tokens") or body.get("max_tokens") or default
    else:
        p = body.get("prompt")
        items = p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
        for item in items:
            if isinstance(item, str):
                prompt += len(item) / cfg.chars_per_token
            elif isinstance(item, list):
                prompt += len(item)
        out = body.get("max_tokens") or cfg.default_max_tokens
    n = body.get("n") or 1
    out = out if isinstance(out, int) and out > 0 else cfg.default_max_tokens
    n = n if isinstance(n, int) and n > 0 else 1
    return max(1, math.ceil(prompt) + out) * n


def affinity_key(body: Mapping[str, Any], chat: bool, cfg: PolicyConfig) -> str | None:
    """The prompt's leading text, or None when affinity is off or the prompt is short."""
    if cfg.affinity_chars <= 0:
        return None
    if chat:
        parts = []
        for m in body.get("messages") or ():
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                parts.append(f"{m.get('role')}:{m['content']}")
        text = "\n".join(parts)
    else:
        p = body.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, list):  # token ids: about chars_per_token characters each
            text = ",".join(map(str, p[: int(cfg.affinity_chars / cfg.chars_per_token)]))
        else:
            text = p if isinstance(p, str) else ""
    if len(text) < cfg.affinity_min_chars:
        return None
    return text[: cfg.affinity_chars]


def rendezvous_weight(key: str, replica_id: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // max(1, block_size))


def is_hot(c: Candidate, tokens: int, headroom: float) -> bool:
    free_after = c.free_blocks - blocks_for(tokens, c.block_size)
    return c.waiting > 0 or free_after < headroom * c.total_blocks


def _better(a: Candidate, b: Candidate, tokens: int) -> Candidate:
    fa = a.free_blocks - blocks_for(tokens, a.block_size)
    fb = b.free_blocks - blocks_for(tokens, b.block_size)
    if fa != fb:
        return a if fa > fb else b
    return a if a.waiting <= b.waiting else b


def choose(cands: Sequence[Candidate], tokens: int, key: str | None, cfg: PolicyConfig,
           rng: random.Random, weights: Mapping[str, float] | None = None,
           exclude: frozenset[str] | set[str] = frozenset()) -> Candidate | None:
    """The replica for one request (None when there is none). `exclude` names replicas this
    request already tried."""
    pool = [c for c in cands if c.replica_id not in exclude]
    if weights:
        version = pick_version(weights, {c.version for c in pool}, rng.random())
        pool = [c for c in pool if c.version == version]
    fresh = [c for c in pool if c.fresh]
    pool = fresh or pool
    if not pool:
        return None
    if key is not None and len(pool) > 1:
        preferred = max(pool, key=lambda c: rendezvous_weight(key, c.replica_id))
        if not is_hot(preferred, tokens, cfg.hot_headroom):
            return preferred
    if len(pool) == 1:
        return pool[0]
    a, b = rng.sample(pool, 2)
    return _better(a, b, tokens)


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


class RetryBudget:
    """Fleet-wide: a retry is allowed while retries in the window stay within
    `max(floor, ratio * max(requests in the window, requests in flight))`."""

    def __init__(self, ratio: float = 0.1, floor: int = 3, window: float = 10.0):
        if ratio < 0 or floor < 0 or window <= 0:
            raise ValueError("retry budget: ratio, floor >= 0 and window > 0")
        self.ratio, self.floor, self.window = ratio, floor, window
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()

    def _prune(self, now: float) -> None:
        cut = now - self.window
        for q in (self._requests, self._retries):
            while q and q[0] < cut:
                q.popleft()

    def note_request(self, now: float) -> None:
        self._requests.append(now)

    def allowed(self, now: float, inflight: int = 0) -> float:
        self._prune(now)
        return max(float(self.floor), self.ratio * max(len(self._requests), inflight))

    def try_spend(self, now: float, inflight: int = 0) -> bool:
        if len(self._retries) + 1 > self.allowed(now, inflight):
            return False
        self._retries.append(now)
        return True

    @property
    def retries_in_window(self) -> int:
        return len(self._retries)


def backoff(retry: int, base: float, cap: float, r: float) -> float:
    """Full jitter: uniform in [0, min(cap, base * 2**retry)) given `r` uniform in [0, 1)."""
    return r * min(cap, base * (2 ** max(0, retry)))
