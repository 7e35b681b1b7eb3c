"""Rollout weights (pure): canary a version by weight, promote or roll back. The admin API that
sets them, and drains replicas, is `admin.py`.

Contract: `Rollout.weights` maps versions to weights; `"*"` is every version not named; empty
means every version. `canary(v, w)` sends share `w` to `v` and the rest to the others,
`promote(v)` sends everything to `v`, `rollback(v)` sends nothing to `v`.
"""

from __future__ import annotations

from batcher.fleet.router.policy import OTHERS


class Rollout:
    """Version weights (pure)."""

    __slots__ = ("weights",)

    def __init__(self) -> None:
        self.weights: dict[str, float] = {}

    def set(self, weights: dict[str, float]) -> None:
        if not isinstance(weights, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                and v >= 0 for k, v in weights.items()):
            raise ValueError("weights must map version names to numbers >= 0")
        self.weights = {k: float(v) for k, v in weights.items()}

    def canary(self, version: str, weight: float) -> None:
        if not 0.0 <= weight <= 1.0:
            raise ValueError("a canary weight is a share in [0, 1]")
        self.weights = {version: weight, OTHERS: 1.0 - weight}

    def promote(self, version: str) -> None:
        self.weights = {version: 1.0}

    def rollback(self, version: str) -> None:
        self.weights = {version: 0.0, OTHERS: 1.0}

    def clear(self) -> None:
        self.weights = {}
