"""The fleet simulator: analytic single-request timings, determinism, policies, the real
scheduler underneath (preemption with a tiny pool), failures and retries, the step model."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from batcher.core.config import SchedulerConfig
from batcher.core.scheduler import Scheduler
from batcher.fleet.router.policy import Candidate
from batcher.core.request import Request
from batcher.core.sampling import SamplingParams
from batcher.sim.calibrate import Point, build_step
from batcher.sim.engine_sim import SimReplica, run_alone
from batcher.sim.fleet_sim import Failure, FleetConfig, FleetSim
from batcher.sim.policies import (
    FleetPolicyAdapter,
    LeastLoaded,
    PowerOfTwoFreeKV,
    RandomChoice,
    RoundRobin,
    RouteRequest,
)
from batcher.sim.stepmodel import (
    ConstantStepModel,
    LinearStepModel,
    composition,
    feature_row,
    fit_linear,
    fit_quality,
    load_step_model,
)
from batcher.sim.workload import ArrivalSpec, ShapeSpec

STEP = 0.05


def _req(rid: str, prompt: int, out: int, t: float = 0.0) -> Request:
    sp = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
    return Request(rid, list(range(1000, 1000 + prompt)), sp, arrival_time=t)


def _replica(num_blocks: int = 256, budget: int = 320, seqs: int = 64) -> SimReplica:
    return SimReplica(0, SchedulerConfig(seqs, budget, 4096), num_blocks, 16,
                      ConstantStepModel(STEP), debug_checks=True)


@pytest.mark.parametrize(("prompt", "chunks"), [(100, 1), (320, 1), (700, 3)])
def test_single_request_timings_are_analytic(prompt: int, chunks: int) -> None:
    out = 10
    [t] = run_alone(_replica(), [(2.0, _req("a", prompt, out, 2.0))])
    assert t.first_token - t.arrival == pytest.approx(chunks * STEP)  # one step per chunk
    assert t.tpot == pytest.approx(STEP)  # then one token per step
    assert t.finished - t.arrival == pytest.approx((chunks + out - 1) * STEP)


def test_fleet_of_one_matches_the_analytic_ttft() -> None:
    cfg = FleetConfig(replicas=1, zones=1, duration=1.0, seed=3)
    shape = ShapeSpec(input_median=100, input_sigma=0.0, output_median=10, output_sigma=0.0)
    res = FleetSim(cfg, ConstantStepModel(STEP), shape, ArrivalSpec("all", count=1)).run()
    assert res.summary["ok"] == 1
    assert res.ttft == [pytest.approx(STEP)]
    assert res.tpot == [pytest.approx(STEP)]
    assert res.e2e == [pytest.approx(10 * STEP)]


def _small_run(seed: int, policy: str = "p2c-kv", **kw) -> dict:
    cfg = FleetConfig(replicas=4, zones=2, duration=20.0, warmup=2.0, seed=seed, policy=policy,
                      **kw)
    shape = ShapeSpec(input_median=64, output_median=16, max_input=256, max_output=64)
    res = FleetSim(cfg, ConstantStepModel(0.02), shape, ArrivalSpec("poisson", rate=20)).run()
    return {k: v for k, v in res.summary.items() if k not in ("wall_seconds", "events_per_s")}


def test_same_seed_same_run() -> None:
    a, b = _small_run(7), _small_run(7)
    assert a == b
    assert a["ok"] > 300
    assert _small_run(8) != a


@pytest.mark.parametrize("policy", ["round-robin", "random", "least-loaded", "p2c-kv"])
def test_every_policy_serves_the_load(policy: str) -> None:
    s = _small_run(1, policy)
    assert s["errors"] == s["rejected"] == 0
    assert s["goodput"] > 0.95


def test_the_real_scheduler_preempts_with_a_tiny_pool() -> None:
    rep = _replica(num_blocks=24)  # 384 token slots for 8 requests that grow to 100 tokens
    assert isinstance(rep.scheduler, Scheduler)
    done = run_alone(rep, [(0.0, _req(str(i), 40, 60)) for i in range(8)])
    assert len(done) == 8 and all(t.tokens == 60 for t in done)
    assert rep.scheduler.stats.preemptions > 0


def test_zone_loss_retries_and_fails_over() -> None:
    s = _small_run(2, failures=[Failure(8.0, zone=0, duration=5.0)], stale_after=1.5)
    assert s["failovers"] + s["retries"] > 0
    assert s["attempt_failures"].get("replica failed", 0) > 0
    assert s["ok"] > 0.9 * s["requests"]


def test_a_zero_budget_turns_failures_into_errors() -> None:
    kw = {"failures": [Failure(8.0, zone=0)], "stale_after": 3.0, "retry_floor": 0}
    none = _small_run(2, retry_ratio=0.0, **kw)
    unlimited = _small_run(2, retry_ratio=None, **kw)
    assert none["errors"] > 0 and none["retry_budget_denied"] > 0
    assert unlimited["errors"] < none["errors"]


@dataclass
class _V:
    index: int
    free_blocks: int
    waiting: int = 0
    running: int = 0
    total_blocks: int = 100
    block_size: int = 16
    zone: int = 0
    fresh: bool = True
    age: float = 0.0
    inflight: int = 0
    others: int = 0
    prefill_tokens: int = 0
    overdue_s: float = 0.0
    prefill_rate: float | None = None
    step_s: float | None = None

    @property
    def replica_id(self) -> str:
        return f"r{self.index}"


def test_policies_choose_as_specified() -> None:
    views = [_V(0, 10), _V(1, 50, waiting=1), _V(2, 40), _V(3, 5)]
    req = RouteRequest("x", 16, 16)
    rr = RoundRobin()
    assert [rr.choose(views, req) for _ in range(5)] == [0, 1, 2, 3, 0]
    assert LeastLoaded().choose(views, req) == 2  # no queue, then most free KV
    tried = RouteRequest("x", 16, 16, tried=frozenset({2}))
    assert LeastLoaded().choose(views, tried) == 0
    assert {RandomChoice(s).choose(views, tried) for s in range(30)} == {0, 1, 3}
    p2 = PowerOfTwoFreeKV(0)
    assert all(p2.choose(views[2:], req) == 0 for _ in range(10))  # 40 free beats 5
    picks = [p2.choose(views, req) for _ in range(400)]
    assert picks.count(3) == 0  # the emptiest never wins a pair
    assert picks.count(1) > picks.count(0)


def test_fleet_policy_adapter_maps_views_and_back() -> None:
    Cand = Candidate  # the fleet router's own view of a replica

    seen = {}

    def choose(cands, tokens, key, cfg, rng, weights, exclude, prompt_tokens):
        seen.update(prompt_tokens=prompt_tokens, tokens=tokens, key=key, exclude=exclude, cfg=cfg)
        pool = [c for c in cands if c.replica_id not in exclude]
        return max(pool, key=lambda c: c.free_blocks)

    pol = FleetPolicyAdapter(choose, Cand, cfg="CFG")
    views = [_V(5, 10), _V(6, 90), _V(7, 30)]
    req = RouteRequest("x", 20, 5, prefix=list(range(100)), tried=frozenset({6}))
    assert pol.choose(views, req) == 2
    assert seen["tokens"] == 25 and seen["exclude"] == {"r6"} and seen["cfg"] == "CFG"
    assert seen["prompt_tokens"] == 20
    assert seen["key"] == ",".join(map(str, range(64)))


def test_step_model_fit_recovers_a_known_model(tmp_path) -> None:
    truth = LinearStepModel(0.012, [3e-4, 2e-3, 4e-4, 0.05, 1e-3, 1e-4], knot=64)
    rng = random.Random(0)
    rows, ys = [], []
    for _ in range(60):
        p = Point(rng.randrange(0, 64), rng.choice([64, 256, 704]), rng.randrange(0, 3),
                  rng.choice([16, 128, 320]), rng.choice([0, 256]))
        if not (p.n_dec or p.chunks):
            continue
        sched = build_step(p, 1 << 20, 16)
        rows.append(feature_row(*composition(sched), knot=64))
        ys.append(truth.step_seconds(sched))
    fit = fit_linear(rows, ys, knot=64)
    assert fit_quality(fit, rows, ys)["mape"] < 1e-6
    assert fit.coef == pytest.approx(truth.coef, rel=1e-4)
    fit.save(tmp_path / "m.json")
    again = load_step_model(str(tmp_path / "m.json"))
    assert again.step_seconds(sched) == pytest.approx(truth.step_seconds(sched))


def test_build_step_has_the_requested_composition() -> None:
    sched = build_step(Point(8, 256, 2, 128, 64), 100, 16)
    assert composition(sched) == (8, 256, 256, 2 * 128 * 192, 2)
    assert all(len(s.block_ids) * 16 >= s.start_pos + len(s.token_ids) for s in sched.seqs)


def test_arrival_processes() -> None:
    rng = random.Random(0)
    assert len(list(ArrivalSpec("poisson", rate=50).times(100, rng))) == pytest.approx(5000,
                                                                                     rel=0.05)
    bursts = list(ArrivalSpec("burst", burst_size=5, burst_interval=2.0).times(10, rng))
    assert bursts == [t for t in (0.0, 2.0, 4.0, 6.0, 8.0) for _ in range(5)]
    d = ArrivalSpec("diurnal", rate=40, amplitude=0.5, period=100)
    times = list(d.times(100, rng))
    assert len(times) == pytest.approx(4000, rel=0.05)
    trough = sum(1 for t in times if t < 10 or t > 90)
    peak = sum(1 for t in times if 40 < t < 60)
    assert peak > 2 * trough


def test_a_fleet_style_policy_drives_a_fleet_through_the_adapter() -> None:
    Cand = Candidate  # the fleet router's own view of a replica

    keys = []

    def choose(cands, tokens, key, cfg, rng, weights, exclude, prompt_tokens):
        keys.append(key)
        pool = [c for c in cands if c.replica_id not in exclude]
        return rng.choice(pool) if pool else None

    cfg = FleetConfig(replicas=3, zones=1, duration=5.0, seed=1)
    shape = ShapeSpec(input_median=64, output_median=8, prefix_groups=2, prefix_tokens=32)
    sim = FleetSim(cfg, ConstantStepModel(0.02), shape, ArrivalSpec("poisson", rate=10),
                   policy=FleetPolicyAdapter(choose, Cand, cfg=None, seed=1))
    s = sim.run().summary
    assert s["ok"] == s["requests"] > 20
    assert {k.split(",")[0] for k in keys} == {"10000", "10032"}  # the two group prefixes
    assert s["prefix_hit_tokens"] > 0


def test_validation_simulates_the_workload_file() -> None:
    from batcher.bench.common import load_workload
    from batcher.sim.stepmodel import ScaledStepModel
    from batcher.sim.validate import compare, offsets, simulate

    work = load_workload(None, 8)
    times = offsets(8, 2.0, seed=0)
    assert times[0] == 0.0 and times == sorted(times) and times == offsets(8, 2.0, seed=0)
    a = simulate(work, times, ConstantStepModel(0.01), SchedulerConfig(), 1024)
    b = simulate(work, times, ScaledStepModel(ConstantStepModel(0.01), 2.0), SchedulerConfig(),
                 1024)
    assert len(a.ttft) == 8 and a.row()["tpot_p50"] == pytest.approx(0.01)
    err = compare(b, a)  # a is the "simulation" of a real run twice as slow
    assert err["tpot_p50"] == pytest.approx(-0.5)


def test_validation_times_every_step_of_the_real_engine(tiny_fp32) -> None:
    """The real half of `batcher sim validate`, on the tiny model: every step's model seconds
    come from the engine's own timing, beside the step model's prediction."""
    import asyncio

    from batcher.sim.validate import _real
    from batcher.tokenizer.tokenizer import load_tokenizer

    work = [{"id": f"v{i}", "prompt_ids": list(range(10 + i, 30 + 2 * i)),
             "max_new_tokens": 6 + i} for i in range(3)]
    stats = asyncio.run(_real(tiny_fp32, load_tokenizer(), work, [0.0, 0.0, 0.01],
                              SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128), 64,
                              ConstantStepModel(0.001)))
    assert len(stats.ttft) == 3 and len(stats.tpot) == 3
    assert stats.slowdown > 0  # measured over predicted: steps were timed


def test_the_fleet_routers_own_policy_runs_through_the_adapter() -> None:
    from batcher.fleet.router import policy as router
    pol = FleetPolicyAdapter(router.choose, router.Candidate, router.PolicyConfig().validate(),
                             seed=1)
    cfg = FleetConfig(replicas=4, zones=2, duration=10.0, seed=1)
    shape = ShapeSpec(input_median=96, output_median=8, prefix_groups=2, prefix_tokens=64)
    s = FleetSim(cfg, ConstantStepModel(0.02), shape, ArrivalSpec("poisson", rate=20),
                 policy=pol).run().summary
    assert s["policy"] == "fleet router policy"
    assert s["ok"] == s["requests"] > 100
    assert s["prefix_hit_tokens"] > 0  # affinity keeps each group's prefix warm somewhere


def test_every_sim_run_flag_has_help_text() -> None:
    import argparse

    from batcher.sim.run_args import fleet_args

    parser = argparse.ArgumentParser()
    fleet_args(parser)
    undocumented = [a.option_strings[0] for a in parser._actions
                    if a.option_strings and a.option_strings[0] != "-h" and not a.help]
    assert undocumented == []
