"""`EngineSnapshot`: the one typed view of a replica's capacity and health.

The gateway (admission, readiness), the metrics, `GET /v1/state`, the `X-Replica-State` header and
the router's registry all read this, never the engine's scheduler or KV manager. Its wire form is
the `/v1/state` contract: the keys

    free_blocks, total_blocks, block_size, running, waiting, version, draining, healthy

keep their names and meanings (routers and tests depend on them); every other key is an addition
that a newer replica may send and an older router ignores.

`from_wire` is strict about types (`ValueError` on a wrong one, so a bad heartbeat is refused, not
half-read) and tolerant about keys: unknown keys are ignored, a missing addition takes its default,
a missing contract key is a `ValueError` (a state without capacity cannot be routed on).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

# The `/v1/state` contract keys, in the order DESIGN lists them.
CONTRACT_KEYS: tuple[str, ...] = ("free_blocks", "total_blocks", "block_size", "running",
                                  "waiting", "version", "draining", "healthy")
# Additions only the operator and the fleet read: server-wide figures of what tenants' prompts
# hit in the prefix cache say something about other tenants' traffic.
PRIVATE_KEYS: frozenset[str] = frozenset({"prefix_hit_tokens"})


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSnapshot:
    """Capacity and health at one instant. Counts are requests unless they say tokens."""

    free_blocks: int
    total_blocks: int
    block_size: int
    running: int
    waiting: int
    version: str
    draining: bool = False
    healthy: bool = True
    # Additions (never rename the keys above):
    waiting_prefill_tokens: int = 0  # prompt tokens of waiting requests not yet computed
    running_prefill_tokens: int = 0  # prompt tokens of running requests still to prefill
    in_flight: int = 0  # client requests the gateway holds (n choices count once)
    error: str | None = None  # why the engine is unhealthy, when it is
    steps: int = 0
    last_step_age: float = 0.0  # seconds since the last model step ended
    preemptions: int = 0
    prefix_hit_tokens: int = 0

    _INTS: ClassVar[tuple[str, ...]] = (
        "free_blocks", "total_blocks", "block_size", "running", "waiting",
        "waiting_prefill_tokens", "running_prefill_tokens", "in_flight", "steps", "preemptions",
        "prefix_hit_tokens")

    @property
    def unserved_prefill_tokens(self) -> int:
        """Prompt tokens accepted but not yet run through the model, waiting and running."""
        return self.waiting_prefill_tokens + self.running_prefill_tokens

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    def to_wire(self) -> dict[str, Any]:
        """JSON-ready dict: the contract keys first, then the additions."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def public_wire(self) -> dict[str, Any]:
        """`to_wire` without `PRIVATE_KEYS`: what anyone may read."""
        return {k: v for k, v in self.to_wire().items() if k not in PRIVATE_KEYS}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> EngineSnapshot:
        """Parse a `/v1/state` JSON object (see the module docstring for what is refused)."""
        if not isinstance(data, Mapping):
            # ValueError, not TypeError: a bad state from the wire is one kind of error for callers.
            raise ValueError(f"a replica state is a JSON object, got {type(data).__name__}")  # noqa: TRY004
        missing = [k for k in CONTRACT_KEYS if k not in data]
        if missing:
            raise ValueError(f"replica state lacks {missing}")
        kw: dict[str, Any] = {}
        for name in _FIELD_NAMES:
            if name not in data:
                continue
            value = data[name]
            if name in _INT_FIELDS:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"replica state {name} must be an integer >= 0, "
                                     f"got {value!r}")
                kw[name] = value
            elif name in ("draining", "healthy"):
                if not isinstance(value, bool):
                    raise ValueError(f"replica state {name} must be true or false, "
                                     f"got {value!r}")
                kw[name] = value
            elif name == "version":
                if not isinstance(value, str):
                    raise ValueError(f"replica state version must be a string, got {value!r}")
                kw[name] = value
            elif name == "error":
                if value is not None and not isinstance(value, str):
                    raise ValueError(f"replica state error must be a string or null, "
                                     f"got {value!r}")
                kw[name] = value
            elif name == "last_step_age":
                if (isinstance(value, bool) or not isinstance(value, int | float)
                        or not math.isfinite(value) or value < 0):
                    raise ValueError(f"replica state last_step_age must be a number >= 0, "
                                     f"got {value!r}")
                kw[name] = float(value)
        if kw["block_size"] < 1:
            raise ValueError("replica state block_size must be >= 1")
        if kw["free_blocks"] > kw["total_blocks"]:
            raise ValueError("replica state has more free blocks than blocks")
        return cls(**kw)


_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(EngineSnapshot))
_INT_FIELDS = frozenset(EngineSnapshot._INTS)


class UnservedPrefill:
    """Prompt tokens not yet computed, queued and in running requests' chunks: a pass over
    every request, kept until the scheduler changes (its `changes` counter), so that the
    snapshots taken between two steps (one on each answer's `X-Replica-State`) cost one pass."""

    __slots__ = ("_at", "_value")

    def __init__(self) -> None:
        self._at = -1
        self._value = (0, 0)

    def of(self, sched: Any) -> tuple[int, int]:
        """(waiting, running) prefill tokens left to compute."""
        if sched.changes != self._at:
            self._at = sched.changes
            self._value = (
                sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting),
                sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in sched.running))
        return self._value


def scheduler_snapshot(sched: Any, kv: Any, *, version: str, draining: bool, healthy: bool,
                       in_flight: int, error: str | None, steps: int,
                       last_step_age: float, unserved: UnservedPrefill) -> EngineSnapshot:
    """The snapshot of a scheduler (`batcher.core.scheduler.Scheduler`) and its KV manager,
    with what only the engine and the gateway know passed in (`unserved`: the engine's cache
    of the queues' prefill sums)."""
    waiting_prefill, running_prefill = unserved.of(sched)
    return EngineSnapshot(
        free_blocks=kv.num_free_blocks,
        total_blocks=kv.num_total_blocks,
        block_size=kv.block_size,
        running=sched.num_running,
        waiting=sched.num_waiting,
        version=version,
        draining=draining,
        healthy=healthy,
        waiting_prefill_tokens=waiting_prefill,
        running_prefill_tokens=running_prefill,
        in_flight=in_flight,
        error=error,
        steps=steps,
        last_step_age=round(last_step_age, 3),
        preemptions=sched.stats.preemptions,
        prefix_hit_tokens=sched.stats.prefix_hit_tokens,
    )
