"""Two studies of cells, at the level of cells rather than of engine steps.

`balance`: C cells of R replicas, S sequence slots each, behind a balancer that runs the real
policy (`batcher.fleet.balancer.policy`: `cell_saturation` on the state each cell publishes every beat,
`choose_cell` on it plus the balancer's own requests sent since). A cell is a FIFO queue in front
of R * S slots; a request holds a slot for an exponential service time (the engine's KV and
decode slots, folded into one number), and its queue wait stands for its time to first token.
Scenarios: even load; a hot tenant sending a fifth of all traffic; a bad deploy that makes one
cell three times slower from a minute in. Policies: `home` (every tenant pinned to its
rendezvous-hash cell, the static split), `random` (any cell), `balancer` (the real policy).
Reported: goodput (queue wait within the SLO; a shed request counts as missed), shed share, p99
wait, the share of the other tenants' requests that met the SLO (does one tenant's burst or one
cell's fault reach everyone else?), and how much traffic left its home cell.

`autoscale`: a fluid model of one fleet over a day (load from a trough to a peak and back, plus a
burst on the morning ramp), minute by minute. Replicas take `delay` minutes from being asked for
to serving. Strategies: a static fleet sized for the peak plus headroom, and an autoscaler
that asks for `ceil(load * (1 + headroom) / (rate * target))` replicas (scale-in after a 10 minute
stabilization). Reported: goodput (arrivals while the backlog's wait is within the SLO) and
replica-hours against the static fleet's.

Both are seeded and take seconds: `python -m batcher.sim.cells_study [--quick]`.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from collections import deque
from dataclasses import dataclass, field, replace

from batcher.fleet.balancer.policy import BalancerConfig, CellView, cell_saturation, choose_cell
from batcher.fleet.balancer.policy import home_cell as _home

POLICIES = ("home", "random", "balancer")


@dataclass(slots=True)
class CellsConfig:
    cells: int = 4
    replicas: int = 8  # per cell
    slots: int = 8  # concurrent sequences per replica
    service_s: float = 2.0  # mean time a request holds its slot
    load: float = 0.75  # arrivals as a share of the fleet's capacity
    tenants: int = 200
    hot_share: float = 0.0  # share of all traffic from one tenant
    bad_cell: int | None = None  # this cell's service time is `bad_factor` x from `bad_at`
    bad_factor: float = 3.0
    bad_at: float = 60.0
    duration: float = 300.0
    warmup: float = 30.0
    beat_s: float = 0.5  # how often cells publish their state
    slo_wait_s: float = 1.0
    policy: str = "balancer"
    seed: int = 0
    balancer: BalancerConfig = field(default_factory=BalancerConfig)


@dataclass(slots=True)
class _Cell:
    cid: str
    capacity: int
    busy: int = 0
    queue: deque[tuple[float, int]] = field(default_factory=deque)  # (arrival, request index)
    mean_service: float = 2.0  # measured, as a router measures its replicas
    published: CellView | None = None
    sent: int = 0  # the balancer's requests since the last publish


@dataclass(slots=True)
class CellsResult:
    goodput: float
    others_goodput: float
    shed: float
    p99_wait: float
    moved: float  # share of requests served outside their tenant's home cell

    def row(self) -> str:
        return (f"{self.goodput:.1%} | {self.others_goodput:.1%} | {self.shed:.1%} | "
                f"{self.p99_wait:.2f} s | {self.moved:.1%}")


def run_cells(cfg: CellsConfig) -> CellsResult:
    """One seeded run (see the module docstring)."""
    if cfg.policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}")
    rng = random.Random(cfg.seed)
    pick_rng = random.Random(cfg.seed + 1)
    cap = cfg.replicas * cfg.slots
    cells = [_Cell(f"c{i}", cap, mean_service=cfg.service_s) for i in range(cfg.cells)]
    names = [CellView(c.cid, 0.0) for c in cells]
    homes = {}
    rate = cfg.load * cfg.cells * cap / cfg.service_s
    events: list[tuple[float, int, int, int]] = []  # (time, kind, cell, request)
    arrivals: list[float] = []
    tenant_of: list[int] = []
    waits: dict[int, float] = {}
    shed: set[int] = set()
    moved = 0
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= cfg.duration:
            break
        arrivals.append(t)
        tenant_of.append(0 if rng.random() < cfg.hot_share else rng.randrange(1, cfg.tenants))
    n = len(arrivals)
    ARRIVE, FINISH, BEAT = 0, 1, 2
    for i, at in enumerate(arrivals):
        events.append((at, ARRIVE, -1, i))
    beat = 0.0
    while beat < cfg.duration:
        events.append((beat, BEAT, -1, -1))
        beat += cfg.beat_s
    heapq.heapify(events)

    def service(c: int, now: float) -> float:
        slow = cfg.bad_factor if c == cfg.bad_cell and now >= cfg.bad_at else 1.0
        return rng.expovariate(1.0 / (cfg.service_s * slow))

    def start(c: int, i: int, now: float) -> None:
        cell = cells[c]
        cell.busy += 1
        waits[i] = now - arrivals[i]
        d = service(c, now)
        cell.mean_service += 0.02 * (d - cell.mean_service)
        heapq.heappush(events, (now + d, FINISH, c, i))

    def publish(cell: _Cell) -> None:
        wait = len(cell.queue) * cell.mean_service / cell.capacity
        sat = cell_saturation(cell.capacity - cell.busy, cell.capacity, len(cell.queue),
                              cfg.replicas, wait, cfg.balancer)
        cell.published = CellView(cell.cid, sat, healthy_replicas=cfg.replicas)
        cell.sent = 0

    for cell in cells:
        publish(cell)
    while events:
        now, kind, c, i = heapq.heappop(events)
        if kind == BEAT:
            for cell in cells:
                publish(cell)
        elif kind == FINISH:
            cell = cells[c]
            cell.busy -= 1
            if cell.queue:
                _, j = cell.queue.popleft()
                start(c, j, now)
            # The answer carries the cell's state (`X-Replica-State`), as through the balancer.
            publish(cell)
        else:
            tenant = f"t{tenant_of[i]}"
            home = homes.get(tenant)
            if home is None:
                home = homes[tenant] = int(_home(names, tenant).cell_id[1:])
            if cfg.policy == "home":
                c = home
            elif cfg.policy == "random":
                c = pick_rng.randrange(cfg.cells)
            else:
                views = [replace(cell.published, unreflected=cell.sent / cell.capacity)
                         for cell in cells]
                chosen = choose_cell(views, tenant, cfg.balancer, pick_rng)
                if chosen is None:
                    shed.add(i)
                    continue
                c = int(chosen.cell_id[1:])
            cells[c].sent += 1
            moved += c != home and arrivals[i] >= cfg.warmup
            if cells[c].busy < cells[c].capacity:
                start(c, i, now)
            else:
                cells[c].queue.append((now, i))
    measured = [i for i in range(n) if arrivals[i] >= cfg.warmup]
    good = [i for i in measured if i not in shed and waits.get(i, math.inf) <= cfg.slo_wait_s]
    others = [i for i in measured if tenant_of[i] != 0]
    others_good = sum(1 for i in others if i not in shed
                      and waits.get(i, math.inf) <= cfg.slo_wait_s)
    # Requests still queued at the end have waited at least until then.
    w = sorted(waits.get(i, cfg.duration - arrivals[i]) for i in measured if i not in shed)
    p99 = w[min(len(w) - 1, int(0.99 * len(w)))] if w else 0.0
    m = max(1, len(measured))
    return CellsResult(len(good) / m, others_good / max(1, len(others)),
                       sum(1 for i in measured if i in shed) / m, p99, moved / m)


SCENARIOS = {
    "even load, 75%": {},
    "hot tenant (20% of traffic), 75%": {"hot_share": 0.2},
    "bad deploy in one cell (3x slower at 60 s), 75%": {"bad_cell": 0},
    "even load, 97% (shedding)": {"load": 0.97},
}


def balance_table(quick: bool = False) -> str:
    base = CellsConfig(duration=120.0 if quick else 300.0)
    head = ("| scenario | policy | goodput | other tenants' goodput | shed | p99 wait | "
            "left home |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    for name, kw in SCENARIOS.items():
        for pol in POLICIES:
            res = run_cells(replace(base, policy=pol, **kw))
            lines.append(f"| {name} | {pol} | {res.row()} |")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class DayConfig:
    peak_rps: float = 1000.0
    trough_share: float = 0.3
    replica_rps: float = 10.0  # requests/s one replica serves at full use
    target: float = 0.85  # the autoscaler's target utilisation
    delay_min: float = 5.0  # asked for -> serving
    headroom: float = 0.1
    burst_at_h: float = 9.0  # on the morning ramp
    burst_min: float = 20.0
    burst_share: float = 0.4  # extra load during the burst
    slo_wait_s: float = 1.0
    scale_in_min: float = 10.0


def load_at(minute: float, cfg: DayConfig) -> float:
    """Requests/s: a trough at 03:00, the peak at 15:00, plus the burst."""
    phase = math.cos(2 * math.pi * (minute / 60 - 15) / 24)
    base = cfg.peak_rps * (cfg.trough_share + (1 - cfg.trough_share) * (phase + 1) / 2)
    b0 = cfg.burst_at_h * 60
    return base * (1 + cfg.burst_share) if b0 <= minute < b0 + cfg.burst_min else base


def run_day(cfg: DayConfig, static: bool) -> tuple[float, float]:
    """(goodput, replica-hours) over one day, minute by minute."""
    def need(rps: float) -> int:
        return math.ceil(rps * (1 + cfg.headroom) / (cfg.replica_rps * cfg.target))

    peak = max(load_at(m, cfg) for m in range(24 * 60))
    serving = need(peak) if static else need(load_at(0, cfg))
    pending: deque[tuple[float, int]] = deque()  # (ready at, count)
    asked = serving
    low_since: float | None = None
    backlog = good = total = hours = 0.0
    for minute in range(24 * 60):
        rps = load_at(minute, cfg)
        while pending and pending[0][0] <= minute:
            serving += pending.popleft()[1]
        if not static:
            want = need(rps)
            if want > asked:
                pending.append((minute + cfg.delay_min, want - asked))
                asked, low_since = want, None
            elif want < serving and not pending:
                low_since = minute if low_since is None else low_since
                if minute - low_since >= cfg.scale_in_min:
                    serving = asked = want
                    low_since = None
        cap = serving * cfg.replica_rps
        backlog = max(0.0, backlog + (rps - cap) * 60)
        wait = backlog / cap if cap > 0 else math.inf
        arrivals = rps * 60
        total += arrivals
        good += arrivals if wait <= cfg.slo_wait_s else 0.0
        hours += (serving + sum(k for _, k in pending)) / 60  # booting replicas are paid for
    return good / total, hours


def autoscale_table() -> str:
    lines = ["| provisioning delay | strategy | goodput | replica-hours | vs static |",
             "|---|---|---|---|---|"]
    for delay in (2.0, 10.0, 30.0):
        base = DayConfig(delay_min=delay)
        static_good, static_h = run_day(replace(base, headroom=0.1), static=True)
        lines.append(f"| {delay:g} min | static for the peak +10% | {static_good:.2%} | "
                     f"{static_h:,.0f} | 100% |")
        for h in (0.0, 0.1, 0.25):
            g, hrs = run_day(replace(base, headroom=h), static=False)
            lines.append(f"| {delay:g} min | autoscale, headroom {h:.0%} | {g:.2%} | "
                         f"{hrs:,.0f} | {hrs / static_h:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m batcher.sim.cells_study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="shorter cell runs")
    args = p.parse_args(argv)
    print("cells behind the balancer (4 cells x 8 replicas x 8 slots, SLO: wait <= 1 s)\n")
    print(balance_table(args.quick))
    print("\nheadroom vs autoscaling over a day (peak 1000 req/s, 10 req/s per replica, "
          "target 85%, a 40% burst for 20 min at 09:00)\n")
    print(autoscale_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
