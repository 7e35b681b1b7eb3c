"""`batcher plan`: the capacity arithmetic reproduces the source's figures."""

from __future__ import annotations

import json

import pytest

from batcher.sim.cli import main
from batcher.sim.plan import Replica, Shape, plan, source_example


def test_source_chat_at_1000_rps() -> None:
    p = plan(Shape("chat", 1000, 250, 1_000, ttft=0.6), Replica(20_000, 2_500, 64), 0.7, 3)
    assert p.replica_seconds == pytest.approx(0.15)
    assert p.compute_exact == pytest.approx(214.3, abs=0.1)  # the source's "~214"
    assert p.by_compute == 215
    assert p.tpot == pytest.approx(0.0256)
    assert p.time_in_system == pytest.approx(7.0)
    assert p.in_flight == pytest.approx(7_000)
    assert p.by_slots == 110
    assert (p.needed, p.binding) == (215, "compute")
    assert p.survive_zone_loss == 3 * 108
    assert p.n_plus_one_per_zone == 3 * (72 + 1)


def test_queue_free_bound_is_below_the_source_figure() -> None:
    p = plan(Shape("chat", 1000, 250, 1_000), Replica(), 0.7, 3)
    assert p.time_in_system == pytest.approx(6.45)
    assert p.in_flight == pytest.approx(6_450)
    assert p.by_slots == 101


@pytest.mark.parametrize(("i", "o", "expected"), [(1000, 250, 21_428.6), (200, 20, 2_571.4),
                                                 (500, 1, 3_628.6)])
def test_source_shapes_at_100k_rps(i: int, o: int, expected: float) -> None:
    p = plan(Shape("x", i, o, 100_000), Replica(), 0.7, 3)
    assert p.compute_exact == pytest.approx(expected, abs=0.1)
    assert p.binding == "compute"


def test_source_example_lists_every_figure() -> None:
    plans = source_example()
    assert [round(p.compute_exact) for p in plans] == [214, 214, 21_429, 2_571, 3_629]
    assert round(plans[0].in_flight) == 7_000 and plans[0].by_slots == 110


def test_equal_share_tpot_makes_slots_match_compute() -> None:
    # With TPOT = slots / decode rate and no queueing, L / slots equals rate x replica-s.
    p = plan(Shape("x", 10, 100, 10), Replica(10_000, 100, 64), 1.0, 1)
    assert p.by_slots == p.by_compute == 11


def test_slots_bind_with_a_slower_measured_tpot() -> None:
    # 100 output tokens at 1 s each: each request lives ~100 s, 1,000 in flight.
    p = plan(Shape("slow", 10, 100, 10, tpot=1.0), Replica(10_000, 100, 64), 1.0, 1)
    assert p.by_compute == 11 and p.by_slots == 16 and p.binding == "slots"
    assert p.survive_zone_loss == p.needed  # one zone: nothing to survive


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError):
        plan(Shape("x", 1, 1, 1), Replica(), 0.0)
    with pytest.raises(ValueError):
        plan(Shape("x", 1, 1, 1), Replica(), 0.7, zones=0)
    with pytest.raises(ValueError):
        Replica(0, 1, 1)
    with pytest.raises(ValueError):
        Shape("x", 1, 0, 1)


def test_cli_example_source_prints_the_figures(capsys) -> None:
    assert main(["plan", "--example", "source"]) == 0
    out = capsys.readouterr().out
    for figure in ("0.15", "214.3 -> 215", "7,000", "110", "21,428.6", "2,571.4", "3,628.6"):
        assert figure in out, figure


def test_cli_shapes_and_json(capsys) -> None:
    assert main(["plan", "--shape", "a:1000:250:1000", "--shape", "b:200:20:100000",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["shape"]["name"] for d in data] == ["a", "b"]
    assert data[1]["by_compute"] == 2572


def test_cli_rates_from_a_step_model(tmp_path, capsys) -> None:
    from batcher.sim.stepmodel import LinearStepModel

    m = LinearStepModel(0.01, [0.001, 0.0, 0.0005, 0.0, 0.0, 0.0])
    path = tmp_path / "m.json"
    m.save(path)
    assert main(["plan", "--from-step-model", str(path), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)[0]["replica"]
    assert rep["prefill_rate"] == pytest.approx(320 / (0.01 + 320 * 0.0005))
    assert rep["decode_rate"] == pytest.approx(64 / (0.01 + 64 * 0.001))
