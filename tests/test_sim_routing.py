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


def compare(flags: str, seeds: int = 1) -> tuple[dict, dict, dict]:
    """Round-robin, the router's policy and the oracle on the same arrivals; with `seeds` > 1
    goodput and p99 TTFT are means over seeds 0.. (a run here is about 200 requests, so one
    run's goodput is about 2 points either way)."""
    out = []
    for policy in ("round-robin", "fleet", "oracle"):
        runs = [run(f"{flags} --seed {s}", policy) for s in range(seeds)]
        mean = {k: sum(r[k] for r in runs) / seeds for k in ("goodput", "ttft_p99")}
        out.append({**runs[0], **mean})
    return out[0], out[1], out[2]


def test_equal_replicas_never_worse_than_round_robin_and_near_the_oracle() -> None:
    rr, fleet, oracle = compare("")
    assert fleet["policy"] == "fleet router policy" and fleet["requests"] > 150
    assert fleet["goodput"] >= rr["goodput"] - 0.005
    assert fleet["goodput"] >= oracle["goodput"] - 0.02


@pytest.mark.parametrize("flags", [
    "--slow-replicas 2:2", "--slow-replicas 2:3", "--small-kv 2:150", "--stall 3@8:5",
    # Overloaded for every policy: 1,000-token prompts meet a 1 s first token only on an idle
    # full-speed replica. Measured in steady state (round-robin's queues on the slow replicas
    # grow for the whole run; over the first 20 s they have not yet).
    ("--slow-replicas 2:2 --input-median 2000 --output-median 40 --load 0.8 "
    "--duration 60 --warmup 10")])
def test_where_replicas_differ_it_beats_round_robin(flags: str) -> None:
    # NOTE: two small pools of eight make the gap to the oracle about a point and a half on
    # average but up to three on one seed, so that row is judged on three; so is the long
    # prompts' row, where one seed put round-robin 9 points ahead of both the policy and the
    # oracle and the next two put it 2-10 points behind
    rr, fleet, oracle = compare(flags, seeds=3 if "small-kv" in flags or "2000" in flags else 1)
    # NOTE: 5 points better where round-robin leaves that much to gain; where it already
    # meets the SLO for more than 90% (two small pools, now that replicas pace first tokens
    # to the SLO: 98.6%), at least half of what it leaves and a lower p99
    gain = min(0.05, (1 - rr["goodput"]) / 2)
    better = ((fleet["goodput"] >= rr["goodput"] + gain
               and (gain == 0.05 or fleet["ttft_p99"] < rr["ttft_p99"]))
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


@pytest.mark.parametrize("piggyback", [True, False])
def test_first_tokens_refresh_the_routers_view_as_the_router_reads_headers(
        piggyback: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from batcher.sim.fleet_types import View

    p = argparse.ArgumentParser()
    add_sim_args(p)
    flags = ["run", "--replicas", "4", "--duration", "4", "--warmup", "1"]
    args = p.parse_args(flags if piggyback else [*flags, "--no-piggyback"])
    cfg, model, shape, arrivals = fleet_from_args(args)
    assert cfg.piggyback is piggyback
    read_on_arrival = []  # a heartbeat is read `heartbeat_delay` after it was measured
    update = View.update

    def spy(self: View, rep: object, measured: float, now: float) -> None:
        read_on_arrival.append(measured == now > 0)
        update(self, rep, measured, now)

    monkeypatch.setattr(View, "update", spy)
    FleetSim(cfg, model, shape, arrivals).run()
    assert any(read_on_arrival) is piggyback
