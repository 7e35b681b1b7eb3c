"""The fleet router's own policy in the simulator, against round-robin and the oracle, on small
fleets of the calibrated CPU step model: never worse than round-robin on equal replicas, close to
the oracle, and clearly better wherever replicas differ (speed, KV, a stall)."""

from __future__ import annotations

import argparse

import pytest

from batcher.sim.cli import add_sim_args, fleet_from_args
from batcher.sim.fleet_sim import FleetSim

pytestmark = pytest.mark.slow

BASE = "--replicas 8 --duration 20 --warmup 4 --load 0.85"


def run(flags: str, policy: str) -> dict:
    p = argparse.ArgumentParser()
    add_sim_args(p)
    args = p.parse_args(["run", *f"{BASE} {flags} --policy {policy}".split()])
    cfg, model, shape, arrivals = fleet_from_args(args)
    return FleetSim(cfg, model, shape, arrivals).run().summary


def compare(flags: str) -> tuple[dict, dict, dict]:
    return run(flags, "round-robin"), run(flags, "fleet"), run(flags, "oracle")


def test_equal_replicas_never_worse_than_round_robin_and_near_the_oracle() -> None:
    rr, fleet, oracle = compare("")
    assert fleet["policy"] == "fleet router policy" and fleet["requests"] > 150
    assert fleet["goodput"] >= rr["goodput"] - 0.005
    assert fleet["goodput"] >= oracle["goodput"] - 0.02


@pytest.mark.parametrize("flags", [
    "--slow-replicas 2:2", "--slow-replicas 2:3",
    # Known gap: the policy beats round-robin by 10 points here but lands 3-4 points behind
    # the oracle, which sees each small pool's free blocks live (86.8% against 90.5%).
    pytest.param("--small-kv 2:150", marks=pytest.mark.xfail(
        strict=True, reason="more than 2 points behind the oracle on small KV pools")),
    "--stall 3@8:5",
    # Known gap: overloaded for every policy (long prompts), round-robin's overloaded slow
    # replicas leave the fast ones idle more often; the policy's p99 TTFT is far better but
    # on eight replicas its goodput is below round-robin's (8.2% against 12.3%).
    pytest.param("--slow-replicas 2:2 --input-median 2000 --output-median 40 --load 0.8",
                 marks=pytest.mark.xfail(strict=True, reason="goodput below round-robin with "
                                         "long prompts on half-speed replicas"))])
def test_where_replicas_differ_it_beats_round_robin(flags: str) -> None:
    rr, fleet, oracle = compare(flags)
    better = (fleet["goodput"] >= rr["goodput"] + 0.05
              or fleet["ttft_p99"] <= 0.7 * rr["ttft_p99"])
    assert better, (rr["goodput"], fleet["goodput"], rr["ttft_p99"], fleet["ttft_p99"])
    assert fleet["goodput"] >= rr["goodput"] - 0.005
    assert fleet["goodput"] >= oracle["goodput"] - 0.02


def test_heterogeneity_flags_reach_the_replicas() -> None:
    p = argparse.ArgumentParser()
    add_sim_args(p)
    args = p.parse_args(["run", *BASE.split(), "--slow-replicas", "2:3", "--small-kv",
                         "1:300", "--stall", "5@1:2"])
    cfg, model, shape, arrivals = fleet_from_args(args)
    sim = FleetSim(cfg, model, shape, arrivals)
    assert [r.step_model.factor for r in sim.replicas[:2]] == [3.0, 3.0]
    assert sim.replicas[2].step_model is model
    assert [r.total_blocks for r in sim.replicas[1:4]] == [cfg.num_blocks, 300, cfg.num_blocks]
    assert sim._stretch(5, 0.5, 1.5) == pytest.approx(3.5)  # held through the stall
    assert sim._stretch(4, 0.5, 1.5) == 1.5
    for bad in (["--slow-replicas", "2"], ["--small-kv", "x:1"], ["--stall", "1@2"]):
        with pytest.raises(SystemExit):  # a usage error naming the flag, not a trace
            p.parse_args(["run", *bad])
    with pytest.raises(ValueError, match="slow replicas"):
        fleet_from_args(p.parse_args(["run", "--replicas", "4", "--slow-replicas", "5:2"]))
