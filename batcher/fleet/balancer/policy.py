"""The global balancer's policy over cells: pure functions, no I/O and no clock of their own, so
the balancer process and the simulator's cells study share them.

A cell is a router with its registry and replicas. It publishes its aggregate state upward (on
`/v1/state` and in the `X-Replica-State` header of every answer) exactly as a replica publishes
its own to a router, with three additions: `saturation` in [0, 1], `predicted_wait_s` and
`healthy_replicas`.

- `cell_saturation(...)` (defined with the state a router publishes, in
  `batcher.fleet.router.saturation`): the largest of three pressures, each 0 when idle and 1 when full: the
  share of KV in use, the queue per healthy replica against `waiting_full`, and the predicted
  queue wait against `wait_full_s`. A cell with no healthy replica is saturated (1.0). The
  largest, not a mean, because any one of them alone makes a new request wait.
- `choose_cell(...)`: a tenant's home cell is the rendezvous-hash winner of its scope over the
  cells (stable while cells come and go: only the tenants of a vanished cell move). The home cell
  takes the request while its saturation is below `shift_at`. Past it, or when home is not
  routable, power of two choices on saturation among the cells below `shed_at` (the home cell
  among them, so a tenant returns home when it is merely the less loaded of two). When no cell
  is below `shed_at`, the answer is `None`: shed now with 503 + Retry-After rather than deepen a
  queue that is already full. Shifting at `shift_at < shed_at` moves traffic before the home
  cell's queue deepens, not after.
- `retry_after(cells, cfg)`: whole seconds for the Retry-After of a shed request.

Why two random choices and not the least saturated cell: several balancers run side by side on
state that is up to a beat old; all of them sending to the one cell that looked emptiest is the
herd that two choices avoid, and it still tracks the least loaded cell closely.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from batcher.fleet.router.policy import rendezvous_weight
from batcher.fleet.router.saturation import BalancerConfig, cell_saturation


@dataclass(slots=True, frozen=True)
class CellView:
    """One cell as the balancer sees it: its last published aggregate and the balancer's own
    judgement of its health (`routable`: healthy, not evicted, not drained)."""

    cell_id: str
    saturation: float
    routable: bool = True
    fresh: bool = True
    healthy_replicas: int = 1
    # The share of the cell's KV the balancer's own requests hold that the published state does
    # not show yet (sent after it), as a router counts its reservations against a replica.
    unreflected: float = 0.0


def effective_saturation(c: CellView, cfg: BalancerConfig) -> float:
    """The published figure plus the KV share of the balancer's own requests sent since (the
    state is as old as the last answer or poll from that cell)."""
    if c.healthy_replicas <= 0:
        return 1.0
    return min(1.0, c.saturation + c.unreflected)


def home_cell(cells: Sequence[CellView], tenant: str) -> CellView | None:
    return max(cells, key=lambda c: rendezvous_weight(tenant, c.cell_id), default=None)


def choose_cell(cells: Sequence[CellView], tenant: str | None, cfg: BalancerConfig,
                rng: random.Random, exclude: frozenset[str] | set[str] = frozenset()
                ) -> CellView | None:
    """The cell for one request, or None when every cell is saturated (shed). `exclude` names
    cells this request already tried."""
    live = [c for c in cells if c.routable and c.cell_id not in exclude]
    live = [c for c in live if c.fresh] or live
    if tenant is not None:
        # Home is judged over every cell, not only the live ones, so a tenant's home does not
        # move while its cell is briefly unroutable.
        home = home_cell(cells, tenant)
        if home is not None and home in live and effective_saturation(home, cfg) < cfg.shift_at:
            return home
    pool = [c for c in live if effective_saturation(c, cfg) < cfg.shed_at]
    if len(pool) <= 1:
        return pool[0] if pool else None
    a, b = rng.sample(pool, 2)
    sa, sb = effective_saturation(a, cfg), effective_saturation(b, cfg)
    if math.isclose(sa, sb, abs_tol=1e-9):
        return a if rng.random() < 0.5 else b
    return a if sa < sb else b


def retry_after(cells: Sequence[CellView], cfg: BalancerConfig) -> int:
    """Seconds a shed client should wait: 1 when some cell is close to taking work again, more
    as the least saturated cell is deeper past `shed_at` or when no cell is routable."""
    live = [effective_saturation(c, cfg) for c in cells if c.routable]
    if not live:
        return 5
    over = min(live) - cfg.shed_at
    return 1 if over <= 0 else min(10, 1 + math.ceil(over * 40))
