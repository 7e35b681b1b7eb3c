"""A router's aggregate state, as a cell publishes it upward: on `GET /v1/state` and in the
`X-Replica-State` header of every answer, so a balancer reads a cell exactly as a router reads a
replica.

The `/v1/state` contract keys are sums over the routable replicas (`healthy` when any is); the
additions are `saturation` in [0, 1] (`saturation.cell_saturation`), `predicted_wait_s` (the least
predicted queue wait over the routable replicas for a reference request, the routing policy's
own estimate minus what the request would take on an idle replica), `healthy_replicas`,
`waiting_prefill_tokens`, and the router's own `in_flight`. No replica address is named: anyone
may read it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from batcher.fleet.router.saturation import BalancerConfig, cell_saturation
from batcher.fleet.router.context import RouterContext
from batcher.fleet.router.policy import Priors, predicted_wait

REFERENCE_PROMPT_TOKENS = 256  # the request `predicted_wait_s` is quoted for


def predicted_queue_wait(ctx: RouterContext) -> float:
    """Seconds of queue ahead of a new reference request on the best routable replica; 0 when
    none is routable (saturation then says 1 through `healthy_replicas`)."""
    cands = ctx.candidates(ctx.clock())
    if not cands:
        return 0.0
    pcfg = ctx.cfg.policy
    priors = Priors.of(cands, pcfg)
    p = REFERENCE_PROMPT_TOKENS
    tokens = p + pcfg.default_max_tokens
    best = float("inf")
    for c in cands:
        idle = dataclasses.replace(c, free_blocks=c.total_blocks, waiting=0, inflight=0,
                                   others=0, prefill_tokens=0, overdue_s=0.0)
        queue = predicted_wait(c, p, tokens, pcfg, priors) - predicted_wait(
            idle, p, tokens, pcfg, priors)
        best = min(best, max(0.0, queue))
    return best


def aggregate(ctx: RouterContext, cfg: BalancerConfig | None = None) -> dict[str, Any]:
    cfg = cfg or BalancerConfig()
    reg = ctx.registry
    live = [r.state for r in reg if reg.routable(r) and r.state is not None]
    free = sum(s.free_blocks for s in live)
    total = sum(s.total_blocks for s in live)
    waiting = sum(s.waiting for s in live)
    wait_s = predicted_queue_wait(ctx) if live else 0.0
    return {
        "free_blocks": free, "total_blocks": total,
        "block_size": min((s.block_size for s in live), default=16),
        "running": sum(s.running for s in live), "waiting": waiting,
        "version": ",".join(sorted({s.version for s in live})), "draining": False,
        "healthy": bool(live), "in_flight": ctx.inflight, "router": True,
        "weights": ctx.rollout.weights, "replicas": len(reg), "routable": len(live),
        "healthy_replicas": len(live),
        "waiting_prefill_tokens": sum(s.waiting_prefill_tokens for s in live),
        "predicted_wait_s": round(wait_s, 4),
        "saturation": round(cell_saturation(free, total, waiting, len(live), wait_s, cfg), 4)}


HEADER_MAX_AGE_S = 0.02
# A value this many max ages old is recomputed before the answer that finds it, not after.
STALE_AFTER_MAX_AGES = 5


class StateHeader:
    """The `X-Replica-State` value on a router's answers: the cell's aggregate without the
    rollout weights. An answer takes the value as it is; one that finds it older than `max_age`
    seconds has it recomputed after it left (on the loop's next turn; at once when no loop
    runs), so the answers of a busy moment share one computation and none waits for it; one
    that finds it older than `STALE_AFTER_MAX_AGES` max ages (after a quiet spell) waits (a
    balancer reads it as a router reads a replica's heartbeat: a little old is fine;
    `GET /v1/state` is always fresh)."""

    __slots__ = ("_at", "_pending", "_value", "clock", "ctx", "max_age")

    def __init__(self, ctx: RouterContext, max_age: float = HEADER_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ctx, self.max_age, self.clock = ctx, max_age, clock
        self._value: str | None = None
        self._at = 0.0
        self._pending = False

    def value(self) -> str:
        age = self.clock() - self._at
        if self._value is None or age >= STALE_AFTER_MAX_AGES * self.max_age:
            self._refresh()  # the first answer after a quiet spell carries a fresh one
        elif not self._pending and age >= self.max_age:
            self._pending = True
            self.ctx.later(self._refresh)
        assert self._value is not None
        return self._value

    def _refresh(self) -> None:
        state = aggregate(self.ctx)
        state.pop("weights", None)
        text = orjson.dumps(state).decode()
        if not text.isascii():  # version labels are the operator's; a header stays ASCII
            text = json.dumps(state, separators=(",", ":"))
        self._value, self._at, self._pending = text, self.clock(), False


class CellCollector(Collector):
    """A router's `batcher_cell_saturation{cell}` (its own, as a balancer would read it) and its
    fleet aggregates, computed at scrape time."""

    def __init__(self, ctx: RouterContext, cell: str):
        self.ctx, self.cell = ctx, cell

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Names without computing values: a second registration is then refused (ValueError).
        yield GaugeMetricFamily("batcher_cell_saturation", "", labels=["cell"])
        for name, _, _ in FLEET_GAUGES:
            yield GaugeMetricFamily(name, "")

    def collect(self) -> Iterator[GaugeMetricFamily]:
        agg = aggregate(self.ctx)
        sat = GaugeMetricFamily("batcher_cell_saturation", "Saturation this cell publishes, 0-1",
                                labels=["cell"])
        sat.add_metric([self.cell], agg["saturation"])
        yield sat
        for name, doc, key in FLEET_GAUGES:
            yield GaugeMetricFamily(name, doc, value=agg[key])


FLEET_GAUGES = (
    ("batcher_fleet_kv_free_blocks", "Free KV blocks over routable replicas", "free_blocks"),
    ("batcher_fleet_kv_total_blocks", "KV blocks over routable replicas", "total_blocks"),
    ("batcher_fleet_running", "Running requests over routable replicas", "running"),
    ("batcher_fleet_waiting", "Waiting requests over routable replicas", "waiting"),
    ("batcher_fleet_healthy_replicas", "Routable replicas", "healthy_replicas"),
    ("batcher_fleet_predicted_queue_wait_seconds",
     "Least predicted queue wait over routable replicas", "predicted_wait_s"))
