"""The retry and health-check flags of `batcher router`, `batcher fleet` and `batcher balancer`,
and the retry budget's of `batcher sim run`: one spelling and one default each, the defaults of
`RouterConfig` and `HealthConfig` (a retry budget of 10% of the last 10 s of requests, plus a floor
of 3, docs/capacity.md and docs/deploy.md)."""

from __future__ import annotations

import argparse
from typing import Any, Protocol

from batcher.flags.types import non_negative_float, non_negative_int, positive_float, positive_int
from batcher.fleet.router.context import RouterConfig
from batcher.fleet.router.health import HealthConfig

_R = RouterConfig()
_H = HealthConfig()


class _Adds(Protocol):
    """A parser or an argument group."""

    def add_argument(self, *args: Any, **kwargs: Any) -> Any: ...


def ratio_or_none(text: str) -> float | None:
    """A retry ratio >= 0, or `none` for no budget (`batcher sim run` only)."""
    return None if text.strip().lower() == "none" else non_negative_float(text)


ratio_or_none.__name__ = "ratio"


def add_retry_budget_args(p: _Adds, *, unlimited: bool = False) -> None:
    """--retry-ratio, --retry-floor, --retry-window; with `unlimited`, --retry-ratio also takes
    `none` (no budget)."""
    a = p.add_argument
    a("--retry-ratio", type=ratio_or_none if unlimited else non_negative_float,
      default=_R.retry_ratio, help="retries allowed in the window, as a share of its requests"
      + (", or 'none' for no budget" if unlimited else "") + " (default: %(default)s)")
    a("--retry-floor", type=non_negative_int, default=_R.retry_floor, help="retries always "
      "allowed in the window (default: %(default)s)")
    a("--retry-window", type=positive_float, default=_R.retry_window, help="retry budget "
      "window in seconds (default: %(default)s)")


def add_retry_health_args(p: _Adds) -> None:
    """Attempts per request, the retry budget and the health rounds of a router or balancer."""
    a = p.add_argument
    a("--max-attempts", type=positive_int, default=_R.max_attempts, help="attempts per "
      "request, the first included (default: %(default)s)")
    add_retry_budget_args(p)
    a("--health-interval", type=positive_float, default=_H.interval, help="seconds between "
      "health rounds (default: %(default)s)")
    a("--liveness-timeout", type=positive_float, default=_H.liveness_timeout, help="seconds "
      "a /health check may take before the round counts it as failed (default: %(default)s)")
    a("--probe-interval", type=positive_float, default=_H.probe_interval, help="seconds "
      "between deep probes (default: %(default)s)")
    a("--probe-deadline", type=positive_float, default=_H.probe_deadline, help="seconds a "
      "deep probe (one token through /v1/probe) may take (default: %(default)s)")
    a("--evict-after", type=positive_int, default=_H.evict_after, help="consecutive failures "
      "that take a replica (on the balancer, a cell) out of routing (default: %(default)s)")
    a("--readmit-after", type=positive_int, default=_H.readmit_after, help="consecutive "
      "passing probes that bring it back (default: %(default)s)")


def health_config(args: argparse.Namespace) -> HealthConfig:
    """The health rounds `add_retry_health_args`' flags ask for."""
    return HealthConfig(interval=args.health_interval, liveness_timeout=args.liveness_timeout,
                        probe_interval=args.probe_interval, probe_deadline=args.probe_deadline,
                        evict_after=args.evict_after, readmit_after=args.readmit_after)


def retry_settings(args: argparse.Namespace) -> dict[str, Any]:
    """`RouterConfig`'s retry fields from `add_retry_health_args`' flags."""
    return {"max_attempts": args.max_attempts, "retry_ratio": args.retry_ratio,
            "retry_floor": args.retry_floor, "retry_window": args.retry_window}
