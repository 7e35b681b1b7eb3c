"""The router's own account of the work it sent each replica, and the rates it measured there.

The router knows exactly what it sent where and what finished; a replica's heartbeat is up to a
few seconds old. So per replica it keeps (no I/O, every method takes `now`):
- `inflight`: its attempts there that have not ended;
- `prefill_tokens`: prompt tokens of those still without a first token, and `overdue_s`, how
  much longer than predicted the oldest of them has waited, or the streams there have gone
  without a token (a stalled replica shows up before any heartbeat says so);
- `prefill_rate`: prompt tokens per second to a first token on an unloaded replica, measured as
  (prompt tokens it had queued there + this prompt) x the slowdown of the sequences in flight
  there when it was sent (as `policy.predicted_wait` applies it) / time to this first token; a
  time-decayed mean, so a slower machine shows up within a few requests;
- `step_s`: seconds per decode step, from the gaps between a stream's tokens;
- `prefill_ahead(reported_unserved)`: `prefill_tokens`, capped for the attempts the last report
  could include by the prompt tokens it showed still unserved;
- `kv_since`: KV tokens the router's own attempts there grew (their streamed tokens) since the
  replica measured its last state, less what those that ended since held (prompt + tokens), so
  free blocks follow the streams between reports: without it a small pool looks fuller than it
  is after requests end and emptier than it is while long answers grow;
- `others(running, waiting)`: what the replica's last report shows beyond the router's own
  requests it could include (those sent before it was measured, still in flight or ended
  since): other routers' work. Without this a report a second old double counts the router's
  own requests that finished since.

`batcher.fleet.router.policy.predicted_wait` turns these into a wait; the simulator keeps the same
account with the same class.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

EWMA_ALPHA = 0.3  # weight of the newest sample: about the last three requests count
SAMPLE_CLAMP = 1.5  # a sample counts as at most this factor off the current estimate
STALL_STEPS = 4.0  # streams without a token for this many measured steps are late


def _ewma(old: float | None, x: float) -> float:
    return x if old is None else old + EWMA_ALPHA * (x - old)


@dataclass(slots=True)
class _Pending:
    sent: float
    prompt: int
    ahead: int  # prompt tokens already queued there when it was sent
    slowdown: float  # 1 + sequences in flight there when sent / seqs_per_step


@dataclass(slots=True)
class _Started:
    first: float
    last: float
    tokens: int = 1
    prompt: int = 0
    counted: bool = False  # the last state seen was measured after it was sent: it shows it


@dataclass(slots=True)
class ReplicaLoad:
    """One replica's account; keys are whatever identifies an attempt to the caller."""

    seqs_per_step: float = 8.0  # as the policy's: sequences that double a prefill's time
    inflight: int = 0
    prefill_tokens: int = 0
    prefill_rate: float | None = None
    step_s: float | None = None
    pending: OrderedDict[Hashable, _Pending] = field(default_factory=OrderedDict)
    started: dict[Hashable, _Started] = field(default_factory=dict)
    sent_at: dict[Hashable, float] = field(default_factory=dict)  # every attempt in flight
    state_at: float = float("-inf")  # when the replica measured the state last seen
    last_token: float = float("-inf")  # when any attempt there last got a token
    unreflected: int = 0  # attempts in flight sent after that measurement
    ended_since: int = 0  # attempts sent before it that have ended since
    kv_since: int = 0  # KV tokens the router's own attempts freed (<0) or grew since it
    prompt_since: int = 0  # prompt tokens of the pending attempts sent since it

    def state_seen(self, measured_at: float) -> None:
        """The replica reported a state measured at `measured_at`."""
        if measured_at <= self.state_at:
            return
        self.state_at = measured_at
        self.unreflected = sum(1 for t in self.sent_at.values() if t >= measured_at)
        self.ended_since = 0
        self.kv_since = 0
        self.prompt_since = sum(p.prompt for p in self.pending.values() if p.sent >= measured_at)
        for key, st in self.started.items():
            st.counted = self.sent_at.get(key, measured_at) < measured_at

    def others(self, running: int, waiting: int) -> int:
        """Sequences in the last report beyond the router's own requests it could include:
        other routers' work."""
        mine = self.inflight - self.unreflected + self.ended_since
        return max(0, running + waiting - mine)

    def prefill_ahead(self, reported_unserved: int) -> int:
        """Prompt tokens of the router's attempts without a first token still to prefill, as
        well as it can tell: all of them, but those the last report could include are at most
        the prompt tokens it showed unserved (chunked prefill is under way there; the report's
        own count is exact, the router's is an estimate made at sending)."""
        if not self.pending:
            return 0
        return min(self.prefill_tokens, self.prompt_since + max(0, reported_unserved))

    def free_blocks(self, reported: int, reserved_since: int, total: int,
                    block_size: int) -> int:
        """KV blocks free on the replica as well as the router can tell: the last report's,
        less what was sent there since (`reserved_since`) and what the router's own streams
        grew since, plus what those that ended since held; never above `total`."""
        return min(total, reported - reserved_since - self.kv_since // max(1, block_size))

    def overdue_s(self, now: float) -> float:
        """How much longer than predicted the oldest request without a first token has waited,
        or the streams there have gone without a token (0 when nothing is late, or nothing is
        measured yet)."""
        late = 0.0
        if self.pending and self.prefill_rate:
            p = next(iter(self.pending.values()))
            expected = (p.ahead + p.prompt) * p.slowdown / self.prefill_rate
            late = now - p.sent - expected
        if self.started and self.step_s:  # streams there, and none got a token for a while
            late = max(late, now - self.last_token - STALL_STEPS * self.step_s)
        return max(0.0, late)

    def sent(self, key: Hashable, prompt_tokens: int, now: float) -> None:
        self.inflight += 1
        self.sent_at[key] = now
        self.unreflected += now >= self.state_at
        slowdown = 1.0 + (self.inflight - 1) / self.seqs_per_step
        self.pending[key] = _Pending(now, prompt_tokens, self.prefill_tokens, slowdown)
        self.prefill_tokens += prompt_tokens
        if now >= self.state_at:
            self.prompt_since += prompt_tokens

    def token(self, key: Hashable, now: float, count: int = 1) -> None:
        """`count` tokens (or chunks of the stream) of attempt `key` arrived, the last at
        `now`."""
        self.last_token = max(self.last_token, now)
        st = self.started.get(key)
        if st is not None:
            st.last = now
            st.tokens += count
            if st.counted:
                self.kv_since += count
            return
        p = self._unpend(key)
        if p is None:
            return
        if now > p.sent:  # the rate an unloaded replica would show, as the policy scales it
            sample = (p.ahead + p.prompt) * p.slowdown / (now - p.sent)
            if self.prefill_rate is not None:  # NOTE: one stall or burst moves it a step only
                sample = min(max(sample, self.prefill_rate / SAMPLE_CLAMP),
                             self.prefill_rate * SAMPLE_CLAMP)
            self.prefill_rate = _ewma(self.prefill_rate, sample)
        sent = self.sent_at.get(key, now)
        self.started[key] = _Started(now, now, count, p.prompt, sent < self.state_at)
        if sent < self.state_at:
            self.kv_since += count

    def done(self, key: Hashable) -> None:
        """Attempt `key` ended (finished, failed or cancelled)."""
        self.inflight -= 1
        sent = self.sent_at.pop(key, None)
        if sent is not None:
            if sent >= self.state_at:
                self.unreflected -= 1
            else:
                self.ended_since += 1
        self._unpend(key)
        st = self.started.pop(key, None)
        if st is not None and st.counted:  # the state showed it: its KV is free now
            self.kv_since -= st.prompt + st.tokens
        if st is not None and st.tokens > 2 and st.last > st.first:
            self.step_s = _ewma(self.step_s, (st.last - st.first) / (st.tokens - 1))

    def _unpend(self, key: Hashable) -> _Pending | None:
        p = self.pending.pop(key, None)
        if p is not None:
            self.prefill_tokens -= p.prompt
            if p.sent >= self.state_at:
                self.prompt_since -= p.prompt
        return p
