"""`batcher plan`: capacity arithmetic for a fleet of replicas.

For a request shape (mean input and output tokens) at a rate, with per-replica prefill and decode
rates, slots (concurrent sequences) and a utilisation target:

- replica-seconds per request  s = input / prefill_rate + output / decode_rate
- replicas by compute          ceil(rate x s / utilisation)
- time in system               W = TTFT + output x TPOT, TPOT = slots / decode_rate (each of the
                               `slots` streams gets an equal share of the decode rate) and TTFT
                               = input / prefill_rate unless given (add queueing by giving it)
- in flight (Little's law)     L = rate x W
- replicas by slots            ceil(L / slots)
- binding                      the larger of the two. With the equal-share TPOT the two differ
                               only by rate x TTFT / slots against the utilisation headroom, so
                               slots bind through queueing, or through a measured TPOT slower
                               than the equal share (prefill chunks interleaved with decodes)
- zones                        survive one zone: Z x ceil(N / (Z - 1)); N+1 in each zone:
                               Z x (ceil(N / Z) + 1)

The source's in-flight figure: 1,000 rps at ~7,000 in flight means W ~ 7 s, and ~110 replicas by
slots pins it (ceil(L / 64) = 110 needs 6.98 <= W <= 7.04 s). Decoding 250 tokens at 64 streams
sharing 2,500 tok/s takes 6.4 s; prefill alone adds 0.05 s (W = 6.45 s, 6,450 in flight, 101 by
slots). The source's 7 s therefore counts a TTFT of ~0.6 s: the prefill plus ~0.55 s of queueing
and batching delay, a typical sub-second TTFT. `--example source` uses TTFT = 0.6 s and prints
the queue-free bound next to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Replica:
    """What one replica sustains: prefill and decode tokens/s, concurrent sequences (slots)."""

    prefill_rate: float = 20_000.0
    decode_rate: float = 2_500.0
    slots: int = 64

    def __post_init__(self) -> None:
        if not (self.prefill_rate > 0 and self.decode_rate > 0 and self.slots >= 1):
            raise ValueError("a replica needs prefill and decode rates > 0 and slots >= 1")


@dataclass(slots=True, frozen=True)
class Shape:
    """A request class: mean input and output tokens, and its rate (requests/s)."""

    name: str
    input_tokens: float
    output_tokens: float
    rate: float
    ttft: float | None = None  # expected TTFT in s (queueing included); None: prefill only
    tpot: float | None = None  # measured TPOT in s; None: slots / decode_rate

    def __post_init__(self) -> None:
        if self.input_tokens < 0 or self.output_tokens < 1 or self.rate < 0:
            raise ValueError("a shape needs input >= 0, output >= 1 and rate >= 0")


@dataclass(slots=True, frozen=True)
class Plan:
    """The arithmetic for one shape on one replica type (floats unrounded, counts ceiled)."""

    shape: Shape
    replica: Replica
    utilisation: float
    zones: int
    replica_seconds: float
    compute_exact: float  # rate x s / utilisation before ceil
    by_compute: int
    tpot: float
    ttft: float
    time_in_system: float
    in_flight: float
    by_slots: int
    needed: int
    binding: str
    survive_zone_loss: int  # total replicas so that Z-1 zones still carry `needed`
    n_plus_one_per_zone: int  # total with one spare in each zone


def plan(shape: Shape, replica: Replica, utilisation: float = 0.7, zones: int = 3) -> Plan:
    """The capacity plan of one shape. Raises ValueError on a utilisation outside (0, 1] or
    fewer than one zone."""
    if not 0 < utilisation <= 1:
        raise ValueError("utilisation must be in (0, 1]")
    if zones < 1:
        raise ValueError("zones must be >= 1")
    s = shape.input_tokens / replica.prefill_rate + shape.output_tokens / replica.decode_rate
    exact = shape.rate * s / utilisation
    by_compute = math.ceil(exact - 1e-9)
    tpot = replica.slots / replica.decode_rate if shape.tpot is None else shape.tpot
    ttft = shape.input_tokens / replica.prefill_rate if shape.ttft is None else shape.ttft
    # NOTE: the first token comes with the prefill; the other output - 1 at TPOT each. The
    # source counts all of them (W = TTFT + output x TPOT); the difference is one TPOT.
    w = ttft + shape.output_tokens * tpot
    in_flight = shape.rate * w
    by_slots = math.ceil(in_flight / replica.slots - 1e-9)
    needed = max(by_compute, by_slots)
    binding = "compute" if by_compute >= by_slots else "slots"
    survive = zones * math.ceil(needed / (zones - 1)) if zones > 1 else needed
    n1 = zones * (math.ceil(needed / zones) + 1)
    return Plan(shape, replica, utilisation, zones, s, exact, by_compute, tpot, ttft, w,
                in_flight, by_slots, needed, binding, survive, n1)


def source_example() -> list[Plan]:
    """The source's figures: its replica, 70% utilisation, 3 zones; chat at 1,000 rps, then
    chat, short and scoring at 100,000 rps each."""
    rep = Replica(20_000, 2_500, 64)
    shapes = [Shape("chat @ 1,000 rps", 1000, 250, 1_000, ttft=0.6),
              Shape("chat @ 1,000 rps, no queueing", 1000, 250, 1_000),
              Shape("chat @ 100,000 rps", 1000, 250, 100_000, ttft=0.6),
              Shape("short @ 100,000 rps", 200, 20, 100_000),
              Shape("scoring @ 100,000 rps", 500, 1, 100_000)]
    return [plan(sh, rep, 0.7, 3) for sh in shapes]


def format_plans(plans: list[Plan]) -> str:
    """A fixed-width table, one column per plan, then the assumptions."""
    rows: list[tuple[str, list[str]]] = [
        ("input / output tokens", [f"{p.shape.input_tokens:,.0f} / {p.shape.output_tokens:,.0f}"
                                   for p in plans]),
        ("rate (req/s)", [f"{p.shape.rate:,.0f}" for p in plans]),
        ("replica-s per request", [f"{p.replica_seconds:.4g}" for p in plans]),
        ("replicas by compute", [f"{p.compute_exact:,.1f} -> {p.by_compute:,}" for p in plans]),
        ("TTFT + out x TPOT (s)", [f"{p.ttft:.2f} + {p.shape.output_tokens:g} x "
                                  f"{p.tpot * 1e3:.1f} ms" for p in plans]),
        ("time in system W (s)", [f"{p.time_in_system:.3g}" for p in plans]),
        ("in flight (rate x W)", [f"{p.in_flight:,.0f}" for p in plans]),
        ("replicas by slots", [f"{p.by_slots:,}" for p in plans]),
        ("needed (binding)", [f"{p.needed:,} ({p.binding})" for p in plans]),
        ("survive 1 zone loss", [f"{p.survive_zone_loss:,} ({p.zones} zones)" for p in plans]),
        ("N+1 per zone", [f"{p.n_plus_one_per_zone:,}" for p in plans]),
    ]
    heads = [p.shape.name for p in plans]
    w0 = max(len(r[0]) for r in rows)
    widths = [max(len(h), *(len(r[1][i]) for r in rows)) for i, h in enumerate(heads)]

    def line(a: str, cells: list[str]) -> str:
        return "  ".join([a.ljust(w0)] + [c.rjust(w) for c, w in zip(cells, widths, strict=True)])

    out = [line("", heads)] + [line(a, cells) for a, cells in rows]
    r, p0 = plans[0].replica, plans[0]
    out.append(f"\nreplica: {r.prefill_rate:,.0f} prefill tok/s, {r.decode_rate:,.0f} decode "
               f"tok/s, {r.slots} slots; utilisation target {p0.utilisation:.0%}")
    return "\n".join(out)
