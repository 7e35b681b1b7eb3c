"""Replicas that differ: the `sim run` flags that say which replicas are slow, short of KV, or
stall (`K:F`, `K:BLOCKS`, `I@T:D`). A slow replica runs `stepmodel.ScaledStepModel`."""

from __future__ import annotations

from batcher.sim.fleet_types import Stall


def parse_pair(spec: str, what: str) -> tuple[int, float]:
    """`K:X` -> (K, X); ValueError naming the flag otherwise."""
    k, sep, x = spec.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(k), float(x)
    except ValueError:
        raise ValueError(f"{what} takes K:X (e.g. 2:3), not {spec!r}") from None


def parse_stall(spec: str) -> Stall:
    """`I@T:D` -> replica I stalls at T for D seconds."""
    i, _, rest = spec.partition("@")
    at, _, dur = rest.partition(":")
    try:
        return Stall(int(i), float(at), float(dur))
    except ValueError as exc:
        raise ValueError(f"--stall takes I@T:D (e.g. 3@20:5), not {spec!r}: {exc}") from None
