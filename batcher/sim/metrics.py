"""What a fleet simulation reports: the numbers `batcher bench` reports (TTFT / TPOT / E2E
percentiles, goodput under SLOs, KV use, preemptions, retries), plus the simulator's own
(herding, attempts, events per second), and per-second series for plots.

Only requests that arrived in [warmup, duration) are measured. Goodput counts requests that
finished with TTFT <= `slo_ttft` and TPOT <= `slo_tpot` (one-token answers have no TPOT), as a
share of the measured requests and as a rate. Herding, per one-second window: the most requests
the router sent to one candidate over the mean per candidate (1.0 is perfectly even; a policy
that follows stale state sends bursts to the replica that looked emptiest; Poisson noise alone
puts it well above 1 when each replica gets a few requests a second). Imbalance, sampled each
second: the coefficient of variation of running + waiting across live replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batcher.bench.common import pct

if TYPE_CHECKING:
    from batcher.sim.engine_sim import SimReplica
    from batcher.sim.fleet_types import FleetConfig, Record

OUTCOMES = ("ok", "error", "rejected")


@dataclass(slots=True)
class FleetResult:
    summary: dict[str, Any]
    arrival: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)  # NaN: no token
    tpot: list[float] = field(default_factory=list)  # NaN: fewer than two tokens
    e2e: list[float] = field(default_factory=list)
    outcome: list[str] = field(default_factory=list)
    good: list[bool] = field(default_factory=list)
    series: dict[str, list[float]] = field(default_factory=dict)


class Collector:
    """Accumulates per-request outcomes and one-second samples during a run."""

    def __init__(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        self.routed = [0] * cfg.replicas
        self.capacity_rejects = 0
        self.failovers = 0
        self.attempt_failures: dict[str, int] = {}
        self.res = FleetResult({})
        self.attempts = 0
        self.retries = 0
        self.series: dict[str, list[float]] = {k: [] for k in (
            "t", "kv_mean", "kv_max", "running", "waiting", "waiting_max", "herding", "imbalance",
            "alive")}

    def finish(self, rec: Record, t: float, outcome: str) -> None:
        cfg, r = self.cfg, self.res
        if not cfg.warmup <= rec.arrival < cfg.duration:
            return
        nan = float("nan")
        ttft = rec.first_token - rec.arrival if rec.first_token is not None else nan
        tpot = nan
        if rec.tokens > 1 and rec.last_token is not None and rec.first_token is not None:
            tpot = (rec.last_token - rec.first_token) / (rec.tokens - 1)
        r.arrival.append(rec.arrival)
        r.ttft.append(ttft)
        r.tpot.append(tpot)
        r.e2e.append(t - rec.arrival)
        r.outcome.append(outcome)
        r.good.append(outcome == "ok" and ttft <= cfg.slo_ttft
                      and not tpot > cfg.slo_tpot)
        self.attempts += rec.attempts
        self.retries += rec.retries

    def sample(self, t: float, reps: list[SimReplica], cands: list[Any]) -> None:
        s = self.series
        alive = [r for r in reps if r.alive]
        uses = [r.kv.usage for r in alive] or [0.0]
        s["t"].append(t)
        s["kv_mean"].append(sum(uses) / len(uses))
        s["kv_max"].append(max(uses))
        s["running"].append(float(sum(r.running for r in alive)))
        waits = [r.waiting for r in alive] or [0]
        s["waiting"].append(float(sum(waits)))
        s["waiting_max"].append(float(max(waits)))
        s["alive"].append(float(len(alive)))
        loads = [r.running + r.waiting for r in alive] or [0]
        mean = sum(loads) / len(loads)
        var = sum((x - mean) ** 2 for x in loads) / len(loads)
        s["imbalance"].append(math.sqrt(var) / mean if mean else math.nan)
        counts = [self.routed[v.index] for v in cands]
        total = sum(counts)
        s["herding"].append(max(counts) * len(counts) / total if total else float("nan"))
        self.routed = [0] * len(self.routed)

    def result(self, reps: list[SimReplica], policy: str, budget_denied: int, now: float,
               events: int, wall: float) -> FleetResult:
        cfg, r = self.cfg, self.res
        r.series = self.series
        n = len(r.outcome)
        ok = [i for i in range(n) if r.outcome[i] == "ok"]
        ttft = [r.ttft[i] for i in ok]
        tpot = [r.tpot[i] for i in ok if not math.isnan(r.tpot[i])]
        e2e = [r.e2e[i] for i in ok]
        span = cfg.duration - cfg.warmup
        kv = [x for t, x in zip(self.series["t"], self.series["kv_mean"], strict=True)
              if cfg.warmup <= t <= cfg.duration]
        herd = [x for x in self.series["herding"] if not math.isnan(x)]
        imb = [x for t, x in zip(self.series["t"], self.series["imbalance"], strict=True)
               if cfg.warmup <= t <= cfg.duration and not math.isnan(x)]
        r.summary = {
            "policy": policy, "replicas": cfg.replicas, "requests": n,
            "ok": len(ok), "errors": r.outcome.count("error"),
            "rejected": r.outcome.count("rejected"),
            "goodput": sum(r.good) / n if n else float("nan"),
            "goodput_rps": sum(r.good) / span if span > 0 else float("nan"),
            "offered_rps": n / span if span > 0 else float("nan"),
            "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90), "ttft_p99": pct(ttft, 99),
            "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
            "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99),
            "kv_use_mean": sum(kv) / len(kv) if kv else float("nan"),
            "preemptions": sum(x.scheduler.stats.preemptions for x in reps),
            "prefix_hit_tokens": sum(x.scheduler.stats.prefix_hit_tokens for x in reps),
            "steps": sum(x.steps for x in reps),
            "attempts_per_request": self.attempts / n if n else float("nan"),
            "retries": self.retries, "failovers": self.failovers,
            "retry_budget_denied": budget_denied,
            "capacity_rejects": self.capacity_rejects,
            "attempt_failures": dict(self.attempt_failures),
            "herding_mean": sum(herd) / len(herd) if herd else float("nan"),
            "imbalance_mean": sum(imb) / len(imb) if imb else float("nan"),
            "utilisation": sum(x.busy_seconds for x in reps) / (cfg.replicas * now)
            if now > 0 else float("nan"),
            "sim_seconds": now, "events": events, "wall_seconds": wall,
            "events_per_s": events / wall if wall > 0 else float("nan"),
        }
        return r


def _ms(x: float) -> str:
    return f"{x * 1e3:,.0f} ms"


def format_summary(s: dict[str, Any]) -> str:
    """A few aligned lines for the terminal."""
    ms = _ms
    lines = [
        (f"policy {s['policy']}, {s['replicas']} replicas, {s['requests']:,} requests measured "
         f"({s['offered_rps']:,.1f}/s): ok {s['ok']:,}, errors {s['errors']:,}, "
         f"rejected {s['rejected']:,}"),
        (f"goodput {s['goodput']:.1%} ({s['goodput_rps']:,.1f}/s); TTFT p50 "
         f"{ms(s['ttft_p50'])} p90 {ms(s['ttft_p90'])} p99 {ms(s['ttft_p99'])}; TPOT p50 "
         f"{ms(s['tpot_p50'])} p99 {ms(s['tpot_p99'])}; E2E p50 {s['e2e_p50']:.2f} s "
         f"p99 {s['e2e_p99']:.2f} s"),
        (f"KV use {s['kv_use_mean']:.1%}, busy {s['utilisation']:.1%}, preemptions "
         f"{s['preemptions']:,}, prefix-hit tokens {s['prefix_hit_tokens']:,}, herding "
         f"{s['herding_mean']:.2f}, imbalance {s['imbalance_mean']:.2f}"),
        (f"attempts/request {s['attempts_per_request']:.3f}, retries {s['retries']:,}, "
         f"failovers {s['failovers']:,}, budget denied {s['retry_budget_denied']:,}, "
         f"capacity rejects {s['capacity_rejects']:,}, {s['attempt_failures']}"),
        (f"simulated {s['sim_seconds']:,.1f} s, {s['steps']:,} steps, {s['events']:,} events "
         f"in {s['wall_seconds']:.1f} s wall = {s['events_per_s']:,.0f} events/s"),
    ]
    return "\n".join(lines)
