"""Sweep mode: one run per offered rate -> the goodput-vs-rate curve and the goodput capacity.

Capacity is DistServe's: the highest request rate at which at least 90% of requests meet both
latency SLOs. Rates are tried in increasing order, and the capacity is the last rate before the
first one that misses: a pass at a higher rate after a miss is noise (or a lucky draw of arrivals),
and a capacity claim should hold for every load below it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

TARGET_SHARE = 0.9


def parse_rates(text: str) -> list[float]:
    """'1,2,4' -> [1.0, 2.0, 4.0], sorted and without repeats."""
    try:
        rates = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"rates must be numbers separated by commas, got {text!r}") from None
    if not rates or rates[0] <= 0:
        raise ValueError("a sweep needs at least one rate, all > 0")
    return rates


def point(rate: float, summary: dict[str, Any]) -> dict[str, Any]:
    """The part of a run's summary that a sweep curve needs."""
    return {"rate": rate, "goodput_rps": summary["goodput_rps"],
            "goodput_share": summary["goodput_share"],
            "request_throughput": summary["request_throughput"],
            "output_tok_s": summary["output_tok_s"], "sent": summary["sent"],
            "ok": summary["ok"], "errors": summary["errors"],
            "ttft_p50_ms": summary["ttft_ms"]["p50"], "ttft_p99_ms": summary["ttft_ms"]["p99"],
            "tpot_p50_ms": summary["tpot_ms"]["p50"], "tpot_p99_ms": summary["tpot_ms"]["p99"]}


def capacity(points: list[dict[str, Any]], target_share: float = TARGET_SHARE) -> float | None:
    """Highest rate such that it and every lower rate kept >= target_share within SLO."""
    best = None
    for p in sorted(points, key=lambda p: p["rate"]):
        if p["goodput_share"] < target_share:
            break
        best = p["rate"]
    return best


async def sweep(rates: list[float], run_one: Callable[[float], Awaitable[dict[str, Any]]],
                stop_after_misses: int = 2) -> list[dict[str, Any]]:
    """Run each rate in increasing order; stop after `stop_after_misses` misses in a row, since
    higher rates only overload the server further and take the longest to drain."""
    points: list[dict[str, Any]] = []
    misses = 0
    for rate in sorted(rates):
        summary = await run_one(rate)
        points.append(point(rate, summary))
        misses = misses + 1 if summary["goodput_share"] < TARGET_SHARE else 0
        if stop_after_misses and misses >= stop_after_misses:
            break
    return points
