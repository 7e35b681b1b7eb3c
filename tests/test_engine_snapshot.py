"""The engine snapshot: its wire form is the `/v1/state` contract, and parsing is strict about
types, tolerant about extra keys and missing additions."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from batcher.engine.snapshot import CONTRACT_KEYS, EngineSnapshot

SNAP = EngineSnapshot(free_blocks=10, total_blocks=16, block_size=16, running=2, waiting=3,
                      version="v1", draining=False, healthy=True, waiting_prefill_tokens=300,
                      running_prefill_tokens=40, in_flight=4, error=None, steps=7,
                      last_step_age=0.25, preemptions=1, prefix_hit_tokens=64)


def test_wire_keys_are_the_contract_then_additions() -> None:
    wire = SNAP.to_wire()
    assert tuple(wire)[:len(CONTRACT_KEYS)] == CONTRACT_KEYS
    assert set(CONTRACT_KEYS) == {"free_blocks", "total_blocks", "block_size", "running",
                                  "waiting", "version", "draining", "healthy"}
    assert EngineSnapshot.from_wire(orjson.loads(orjson.dumps(wire))) == SNAP
    assert SNAP.unserved_prefill_tokens == 340 and SNAP.used_blocks == 6


def test_snapshot_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SNAP.running = 5  # type: ignore[misc]


def test_extra_keys_ignored_missing_additions_defaulted() -> None:
    wire = {k: SNAP.to_wire()[k] for k in CONTRACT_KEYS}
    wire["some_future_key"] = {"x": 1}
    snap = EngineSnapshot.from_wire(wire)
    assert snap.free_blocks == 10 and snap.version == "v1"
    assert snap.waiting_prefill_tokens == 0 and snap.error is None and snap.last_step_age == 0.0


@pytest.mark.parametrize("key", CONTRACT_KEYS)
def test_missing_contract_key_is_refused(key: str) -> None:
    wire = SNAP.to_wire()
    del wire[key]
    with pytest.raises(ValueError, match=key):
        EngineSnapshot.from_wire(wire)


@pytest.mark.parametrize(("key", "value"), [
    ("free_blocks", "10"), ("free_blocks", 1.5), ("free_blocks", True), ("free_blocks", -1),
    ("running", None), ("version", 2), ("draining", "false"), ("healthy", 1),
    ("waiting_prefill_tokens", "x"), ("error", 5), ("last_step_age", "0.1"),
    ("last_step_age", float("nan")), ("last_step_age", -1), ("block_size", 0),
    ("free_blocks", 17),
])
def test_wrong_types_are_value_errors(key: str, value: object) -> None:
    wire = dict(SNAP.to_wire(), **{key: value})
    with pytest.raises(ValueError):
        EngineSnapshot.from_wire(wire)


def test_not_an_object() -> None:
    for bad in ([], "state", 3, None):
        with pytest.raises(ValueError):
            EngineSnapshot.from_wire(bad)  # type: ignore[arg-type]
