"""What a cell publishes about itself, and how full that is: the contract between a router
(which computes its own saturation for `/v1/state`) and the global balancer above it (which
judges cells by it). Pure; no I/O.

`cell_saturation(...)` is the largest of three pressures, each 0 when idle and 1 when full: the
share of KV in use, the queue per healthy replica against `waiting_full`, and the predicted queue
wait against `wait_full_s`. A cell with no healthy replica is saturated (1.0). The largest, not a
mean, because any one of them alone makes a new request wait. `BalancerConfig` holds those
bounds and the balancer's thresholds (`batcher.fleet.balancer.policy`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class BalancerConfig:
    shift_at: float = 0.8  # the home cell keeps its tenants below this saturation
    shed_at: float = 0.95  # no cell below this: shed with 503 + Retry-After
    waiting_full: float = 8.0  # queued requests per healthy replica that count as full
    wait_full_s: float = 2.0  # predicted queue wait that counts as full

    def validate(self) -> BalancerConfig:
        if not 0.0 < self.shift_at <= self.shed_at <= 1.0:
            raise ValueError("need 0 < shift_at <= shed_at <= 1")
        if self.waiting_full <= 0 or self.wait_full_s <= 0:
            raise ValueError("waiting_full and wait_full_s must be > 0")
        return self



def cell_saturation(free_blocks: int, total_blocks: int, waiting: int, healthy_replicas: int,
                    predicted_wait_s: float, cfg: BalancerConfig) -> float:
    """The published saturation of a cell in [0, 1] (see the module docstring)."""
    if healthy_replicas <= 0 or total_blocks <= 0:
        return 1.0
    kv = 1.0 - free_blocks / total_blocks
    queue = waiting / (healthy_replicas * cfg.waiting_full)
    wait = predicted_wait_s / cfg.wait_full_s
    return min(1.0, max(0.0, kv, queue, wait))


__all__ = ["BalancerConfig", "cell_saturation"]
