"""Warm start and admission calibrated to the device, on the simulated clock.

A replica whose model is fast (the fake model's formula at `--fake-decode-step-ms 3
--fake-prefill-rate 50000`: a GPU-sized device, not the CPU the step-time prior was measured on)
takes bursts through the production `Admission`. After the calibration plan `batcher serve` runs
before it reports ready, a burst whose first tokens fit the SLO is admitted whole, and a burst
beyond capacity is refused only for its excess, with the admitted first tokens within the SLO.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from batcher.admission.admission import Rejected
from batcher.core.config import CUDA_MAX_NUM_BATCHED_TOKENS, CUDA_MAX_NUM_SEQS, SchedulerConfig
from batcher.core.calibration import Plan, calibration_plan, warmup_plan
from batcher.core.outputs import SchedulerOutput
from batcher.core.stalls import StallDetector, StallLog
from batcher.core.step_time import StepShape
from batcher.core.request import Request
from batcher.core.sampling import SamplingParams
from batcher.sim.engine_sim import SimReplica, Timing
from batcher.sim.warm_sim import run_plan
from batcher.admission.slo_limit import SloLimit

SLO_S = 2.0
CHAT64 = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "chat64.json"
if not CHAT64.is_file():
    CHAT64 = Path(__file__).resolve().parents[1] / "workloads" / "chat64.json"


@dataclass(slots=True)
class FakeDevice:
    """The fake model's step time (`batcher.engine.fake_runner.FakeRunner.step_seconds`)."""

    decode_step_s: float = 0.003
    per_seq_s: float = 0.0002
    prefill_rate: float = 50_000.0

    def step_seconds(self, sched: SchedulerOutput) -> float:
        shape = StepShape.of(sched)
        return (self.decode_step_s + shape.decode_rows * self.per_seq_s
                + shape.prefill_tokens / self.prefill_rate)


def replica(calibrated: bool) -> SimReplica:
    cfg = SchedulerConfig(max_num_seqs=CUDA_MAX_NUM_SEQS,
                          max_num_batched_tokens=CUDA_MAX_NUM_BATCHED_TOKENS,
                          max_model_len=4096, slo_ttft_s=SLO_S).validate()
    rep = SimReplica(0, cfg, num_blocks=16384, block_size=16, step_model=FakeDevice())
    # `batcher serve`'s defaults on a device: the queue bound is four batches.
    rep.use_admission(slo_ttft_s=SLO_S, max_waiting=4 * cfg.max_num_seqs,
                      max_num_seqs=cfg.max_num_seqs)
    if calibrated:
        end = run_plan(rep, calibration_plan(cfg, cfg.max_model_len, 16384 * 16))
        rep.now = end + 1.0  # the server starts listening a moment later
    return rep


@dataclass(slots=True)
class Burst:
    admitted: int = 0
    refused: int = 0
    ttfts: list[float] | None = None

    def p99(self) -> float:
        ordered = sorted(self.ttfts or [0.0])
        return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def burst(rep: SimReplica, shapes: list[tuple[int, int]], spread_s: float,
          admit: bool = True) -> Burst:
    """`shapes` (prompt, max_tokens) arriving evenly over `spread_s` (an HTTP burst is read and
    tokenized over a short span, while steps run), offered through admission (or added
    without it); every admitted request runs to the end."""
    start = rep.now
    rng = random.Random(3)
    arrivals = [(start + spread_s * i / len(shapes), p, m) for i, (p, m) in enumerate(shapes)]
    firsts: dict[str, float] = {}
    arrived: dict[str, float] = {}
    out = Burst()

    def on_token(t: Timing, at: float) -> None:
        if t.request_id in arrived and t.request_id not in firsts:
            firsts[t.request_id] = at - arrived[t.request_id]

    rep.on_token = on_token
    i, now, end = 0, start, None
    while i < len(arrivals) or end is not None or rep.scheduler.has_unfinished():
        if end is not None and (i >= len(arrivals) or end <= arrivals[i][0]):
            now, end = end, None
            rep.finish_step(now)
        elif i < len(arrivals):
            now, prompt, max_tokens = arrivals[i]
            rid = f"b{i}"
            req = Request(rid, [rng.randrange(1000, 40000) for _ in range(prompt)],
                          SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            timing = Timing(rid, now, prompt, max_tokens)
            try:
                if admit:
                    rep.offer(req, timing, now)
                else:
                    rep.add(req, timing, now)
            except Rejected:
                out.refused += 1
            else:
                out.admitted += 1
                arrived[rid] = now
            i += 1
        if end is None and rep.scheduler.has_unfinished():
            end = rep.start_step(now)
    out.ttfts = list(firsts.values())
    return out


def chat64() -> list[tuple[int, int]]:
    reqs = json.loads(CHAT64.read_text())["requests"]
    return [(r["prompt_len"], r["max_new_tokens"]) for r in reqs]


def test_plans_fit_the_pool_and_the_context() -> None:
    cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=320, max_model_len=2048)
    for plan in (warmup_plan(cfg, 2048, 4096), calibration_plan(cfg, 2048, 4096)):
        assert isinstance(plan, Plan) and plan.requests > 0
        for wave in plan.waves:
            tokens = sum(g.count * (g.prompt_tokens + g.max_tokens)
                         for g in (*wave.first, *wave.late))
            assert tokens <= 4096
            for g in (*wave.first, *wave.late):
                assert g.count <= cfg.max_num_seqs
                assert 1 <= g.prompt_tokens + g.max_tokens <= 2048
    # Every sampling path is warmed once.
    assert warmup_plan(cfg, 2048, 4096).waves[-2].sampling[0] == "greedy"


def test_calibration_leaves_the_prior_for_the_device() -> None:
    rep = replica(calibrated=True)
    model, device = rep.step_time_model, FakeDevice()
    for rows in (1, 32, 256):
        want = device.decode_step_s + rows * device.per_seq_s
        got = model.predict(StepShape(rows, 64))
        assert got == pytest.approx(want, rel=0.35), (rows, got, want)
    got = model.predict(StepShape().plus(2048, 0))
    assert got == pytest.approx(device.decode_step_s + 2048 / device.prefill_rate, rel=0.35)


def test_chat64_burst_is_admitted_whole_after_calibration() -> None:
    got = burst(replica(calibrated=True), chat64(), spread_s=0.1)
    assert got.refused == 0, got
    assert got.p99() <= SLO_S


def test_burst_of_1024_that_fits_is_admitted_whole() -> None:
    shapes = [(32, 4)] * 1024
    alone = burst(replica(calibrated=True), shapes, spread_s=0.2, admit=False)
    assert alone.p99() < 0.8 * SLO_S  # the burst fits the SLO by a margin
    got = burst(replica(calibrated=True), shapes, spread_s=0.2)
    assert got.refused == 0, got
    assert got.p99() <= SLO_S


def test_burst_beyond_capacity_is_refused_only_for_its_excess() -> None:
    shapes = [(200, 64)] * 1024
    alone = burst(replica(calibrated=True), shapes, spread_s=0.2, admit=False)
    fit = sum(1 for t in alone.ttfts or [] if t <= SLO_S)
    assert fit < 1024  # beyond capacity
    got = burst(replica(calibrated=True), shapes, spread_s=0.2)
    assert got.refused > 0
    assert got.p99() <= SLO_S
    assert got.admitted >= 0.9 * fit, (got.admitted, fit)


def test_stalls_are_not_misses() -> None:
    log = StallLog()
    det = StallDetector(log)
    # A compile: one step 1.2 s where 5 ms was predicted.
    assert det.step(started=10.0, seconds=1.2, predicted_s=0.005, gap_s=0.0)
    assert log.overlap(9.0, 12.0) == pytest.approx(1.195)
    # Three slow steps in a row are the machine's new speed, not a stall.
    assert det.step(11.3, 0.2, 0.01, 0.0)
    assert not det.step(11.6, 0.2, 0.01, 0.0)
    # A gap between steps with work pending (the loop held up) is a stall.
    det.step(13.0, 0.005, 0.005, gap_s=0.4)
    assert log.overlap(12.0, 13.0) == pytest.approx(0.4)
    limit = SloLimit()
    share = limit.share
    # A request that waited 2.5 s of which 1.2 s was a stall met a 2 s SLO.
    waited = 2.5 - log.overlap(9.5, 12.0)
    limit.observe(12.0, 9.5, waited, SLO_S)
    assert limit.share >= share and limit.cuts == 0
