"""The per-step prefill budget on a simulated clock: a fake runner whose step time follows a known
formula, the scheduler sizing chunks with the online step-time model it feeds. The chosen budgets
keep steps carrying decodes within the target, adapt when the step time changes, give the
longest-waiting prefill its chunk every step, and give prefill the whole budget when nothing
decodes."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from batcher.core.config import SchedulerConfig
from batcher.core.kv_cache_manager import KVCacheManager
from batcher.core.outputs import RunnerOutput, SchedulerOutput
from batcher.core.scheduler import Scheduler
from batcher.core.step_budget import PrefillAllowance
from batcher.core.step_time import OnlineStepTimeModel, StepShape
from batcher.core.request import Priority, Request
from batcher.core.sampling import SamplingParams

BS = 16


def cpu_like(shape: StepShape) -> float:
    """The bundled model on a 2-core CPU, roughly: a prefill token costs about a decode row, and
    a chunk's attention grows with its context."""
    return (0.02 + 6e-4 * shape.decode_rows + 3e-3 * shape.decode_rows * shape.decode_ctx / 1e3
            + 2.5e-4 * shape.prefill_tokens + 0.3 * shape.prefill_attn / 1e6
            + 2e-3 * shape.prefill_chunks)


@dataclass
class Sim:
    """A scheduler, a KV pool and a fake runner on a simulated clock."""

    config: SchedulerConfig
    formula: object = cpu_like
    scale: float = 1.0
    model: OnlineStepTimeModel = field(default_factory=OnlineStepTimeModel)
    now: float = 0.0
    # Seconds per 1k tokens of context each prefill chunk reads, whatever its length (the
    # gather and scan of its cached context in every layer).
    context_read_s: float = 0.0

    def __post_init__(self) -> None:
        self.kv = KVCacheManager(4096, BS, enable_prefix_caching=False)
        self.sched = Scheduler(self.config, self.kv, clock=lambda: self.now, debug_checks=True,
                               step_time=self.model)
        self.token_times: dict[str, list[float]] = {}
        self.steps: list[tuple[SchedulerOutput, float, float | None]] = []

    def add(self, rid: str, prompt_len: int, max_tokens: int) -> None:
        ids = [(i * 31 + len(rid)) % 4000 + 10 for i in range(prompt_len)]
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.sched.add_request(Request(rid, ids, sp, arrival_time=self.now))
        self.token_times[rid] = []

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        allowance = self.sched.last_allowance
        shape = StepShape.of(out, BS)
        read = sum(s.start_pos + len(s.token_ids) for s in out.seqs if not s.is_decode)
        seconds = self.scale * (self.formula(shape)  # type: ignore[operator]
                                + self.context_read_s * read / 1e3)
        self.now += seconds
        self.model.observe(shape, seconds)
        self.steps.append((out, seconds, allowance.target_s if allowance else None))
        ids = [s.request_id for s in out.seqs if s.sample]
        for u in self.sched.update(out, RunnerOutput(ids, [7] * len(ids), [])):
            self.token_times[u.request_id].append(self.now)
        return out

    def run_until(self, done, limit: int = 5000) -> None:
        for _ in range(limit):
            if done():
                return
            self.step()
        raise AssertionError("did not finish")

    def steady(self, rows: int, ctx: int) -> float:
        return self.scale * self.formula(StepShape(rows, -(-ctx // BS) * BS))  # type: ignore


def prefill_of(out: SchedulerOutput, rid: str) -> int:
    return sum(len(s.token_ids) for s in out.seqs if s.request_id == rid)


def streams_then_long_prompt(sim: Sim, long_len: int = 2000) -> int:
    """8 streams decode, then a long prompt arrives; returns the step index it arrived at."""
    for i in range(8):
        sim.add(f"s{i}", 100, 400)
    sim.run_until(lambda: all(len(sim.token_times[f"s{i}"]) >= 60 for i in range(8)))
    sim.add("long", long_len, 2)
    arrival = len(sim.steps)
    sim.run_until(lambda: bool(sim.token_times["long"]))
    return arrival


def gaps_while(sim: Sim, start: float, end: float) -> list[float]:
    gaps = []
    for i in range(8):
        t = sim.token_times[f"s{i}"]
        gaps += [b - a for a, b in itertools.pairwise(t) if start < b <= end]
    return gaps


def test_default_target_keeps_streams_within_one_and_a_half_steady() -> None:
    sim = Sim(SchedulerConfig(64, 320, 4096))
    arrival = streams_then_long_prompt(sim)
    mixed = [(out, t, target) for out, t, target in sim.steps[arrival:]
             if prefill_of(out, "long") > 0]
    assert len(mixed) > 8  # the prompt was split into many small chunks
    for out, seconds, target in mixed:
        # The streams' rows (the prompt's last token alone would be a one-token row too).
        streams = [s for s in out.seqs if s.is_decode and s.request_id != "long"]
        assert len(streams) == 8 and target is not None
        steady = sim.steady(8, max(s.start_pos + 1 for s in streams))
        # The model was learned from this formula: within 10% of the 1.5x target.
        assert seconds <= 1.5 * steady * 1.1, (seconds, steady)
    start = sum(t for _, t, _ in sim.steps[:arrival])
    gaps = sorted(gaps_while(sim, start, sim.now))
    assert len(gaps) == 8 * len(sim.steps[arrival:])
    steady = sim.steady(8, 200)
    assert gaps[int(0.99 * (len(gaps) - 1))] <= 1.5 * steady * 1.1
    # Every step from its arrival to its first token carried a chunk of it.
    assert len(mixed) == len(sim.steps[arrival:])


def test_long_context_chunks_stay_within_the_target_however_small() -> None:
    """As on the bundled model on a CPU: a chunk reads its whole context, so deep into a 2k-token
    prompt even a 16-token chunk costs most of a steady step. The chunk is then sized to what
    fits, below any token minimum, and the streams stay within 1.5x; the prompt still moves
    every step."""
    sim = Sim(SchedulerConfig(64, 320, 4096), context_read_s=5e-3)
    arrival = streams_then_long_prompt(sim)
    chunk16 = cpu_like(StepShape(8, 320).plus(16, 1984, BS)) + 5e-3 * 2.0
    assert chunk16 > 1.75 * sim.steady(8, 320)  # a 16-token minimum alone breaks the target
    mixed = sim.steps[arrival:]
    chunks = [prefill_of(out, "long") for out, _, _ in mixed]
    # Progress every step (the last chunk is whatever remains).
    assert min(chunks[:-1]) >= 2 and sum(chunks) == 2000
    assert min(chunks) < 16  # below the old token minimum
    ratios = []
    for out, seconds, _ in mixed:
        ctx = max(s.start_pos + 1 for s in out.seqs if s.is_decode)
        ratios.append(seconds / sim.steady(8, ctx))
    # The model was learned from this formula: within 10% of the 1.5x target, deep into the
    # prompt too.
    assert max(ratios) <= 1.5 * 1.1, max(ratios)
    start = sum(t for _, t, _ in sim.steps[:arrival])
    gaps = sorted(gaps_while(sim, start, sim.now))
    end_ctx = max(s.start_pos + 1 for s in mixed[-1][0].seqs if s.is_decode)
    assert gaps[int(0.99 * (len(gaps) - 1))] <= 1.5 * sim.steady(8, end_ctx) * 1.1


def test_minimum_chunk_applies_only_when_nothing_fits() -> None:
    model = OnlineStepTimeModel()
    decode = StepShape(8, 128)
    steady = model.predict(decode)
    roomy = PrefillAllowance(model, 1.5 * steady, decode, min_chunk=16)
    n = roomy.chunk(1990, 500)
    assert 2 <= n < 16  # what fits the time, not the token minimum
    assert model.predict(decode.plus(n, 1990)) <= 1.5 * steady
    assert model.predict(decode.plus(n + 1, 1990)) > 1.5 * steady
    tight = PrefillAllowance(model, steady, decode, min_chunk=16)
    assert tight.chunk(1990, 500) == 16 and tight.chunk(1990, 5) == 5  # nothing fits: progress
    tight.take(16, 1990)
    assert tight.chunk(0, 500) == 0  # only the step's first chunk is guaranteed


def test_fixed_budget_is_the_old_behaviour_and_stalls_streams() -> None:
    sim = Sim(SchedulerConfig(64, 320, 4096, prefill_budget="fixed"))
    streams_then_long_prompt(sim)
    chunks = [prefill_of(out, "long") for out, _, _ in sim.steps if prefill_of(out, "long")]
    assert chunks[:-1] == [320 - 8] * (len(chunks) - 1)
    worst = max(t for out, t, _ in sim.steps if prefill_of(out, "long"))
    assert worst > 3 * sim.steady(8, 200)  # what the time budget exists to prevent


def test_slo_target_lets_chunks_grow_to_the_slo() -> None:
    sim = Sim(SchedulerConfig(64, 320, 4096, slo_tpot_s=0.1))
    streams_then_long_prompt(sim)
    mixed = [(out, t) for out, t, _ in sim.steps if prefill_of(out, "long")]
    assert all(t <= 0.1 * 1.1 for _, t in mixed)
    default = Sim(SchedulerConfig(64, 320, 4096))
    streams_then_long_prompt(default)
    # A looser target than 1.5x steady: fewer, larger chunks and a shorter TTFT.
    assert sim.sched.stats.steps < default.sched.stats.steps


def test_budget_adapts_when_the_machine_slows_down() -> None:
    sim = Sim(SchedulerConfig(64, 320, 4096, slo_tpot_s=0.12))
    for i in range(8):
        sim.add(f"s{i}", 100, 2000)
    sim.run_until(lambda: sim.now > 3.0)
    sim.add("long1", 1500, 2)
    sim.run_until(lambda: bool(sim.token_times["long1"]))
    before = [prefill_of(o, "long1") for o, _, _ in sim.steps if prefill_of(o, "long1")]
    sim.scale = 1.6  # a neighbour takes the cores
    t0 = sim.now
    sim.run_until(lambda: sim.now > t0 + 2.0)
    sim.add("long2", 1500, 2)
    sim.run_until(lambda: bool(sim.token_times["long2"]))
    after = [(o, t) for o, t, _ in sim.steps if prefill_of(o, "long2")]
    assert all(t <= 0.12 * 1.1 for _, t in after)
    assert max(prefill_of(o, "long2") for o, _ in after) < max(before)


def test_nothing_decoding_gives_prefill_the_whole_budget() -> None:
    sim = Sim(SchedulerConfig(64, 320, 4096))
    sim.add("long", 1000, 2)
    first = sim.step()
    assert prefill_of(first, "long") == 320 and sim.sched.last_allowance is None
    sim.run_until(lambda: bool(sim.token_times["long"]))
    assert [prefill_of(o, "long") for o, _, _ in sim.steps] == [320, 320, 320, 40]


def test_longest_waiting_prefill_goes_first_and_none_starves() -> None:
    sim = Sim(SchedulerConfig(64, 320, 4096))
    for i in range(8):
        sim.add(f"s{i}", 100, 600)
    sim.run_until(lambda: all(sim.token_times[f"s{i}"] for i in range(8)))
    sim.add("old", 800, 2)
    sim.now += 0.01
    sim.add("new", 800, 2)
    arrival = len(sim.steps)
    sim.run_until(lambda: bool(sim.token_times["old"]))
    chunks = [prefill_of(out, "old") for out, _, _ in sim.steps[arrival:]]
    # Progress every step, in order (chunks sized to the target less the fit's recent overrun).
    assert min(chunks[:-1]) >= 8 and sum(chunks) == 800
    sim.run_until(lambda: bool(sim.token_times["new"]))
    assert sim.token_times["old"][0] < sim.token_times["new"][0]


@pytest.mark.parametrize("bad", [{"prefill_budget": "auto"}, {"slo_tpot_s": 0.0},
                                 {"max_step_slowdown": 0.9}, {"min_prefill_chunk": 0}])
def test_bad_budget_settings_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(**bad).validate()


async def test_engine_feeds_its_model_every_step_and_the_scheduler_reads_it(tiny_fp32) -> None:
    from batcher.engine.engine import AsyncEngine
    from batcher.runtime.model_runner import ModelRunner
    from batcher.tokenizer.tokenizer import load_tokenizer

    runner = ModelRunner(tiny_fp32, num_blocks=64, block_size=BS)
    engine = AsyncEngine(runner, load_tokenizer(), SchedulerConfig(8, 64, 512),
                         debug_checks=True)
    assert engine.scheduler.step_time is engine.step_time_model
    await engine.start()
    try:
        sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        async for _ in engine.generate(Request("a", list(range(100, 250)), sp)):
            pass
    finally:
        await engine.stop()
    assert engine.steps == 3 + 5  # 150 prompt tokens in chunks of 64, then 5 decodes
    # Every step but a stalled one (the model thread's first step may be: a cold start).
    stalled = engine.stall_log.count
    assert stalled <= 1
    assert engine.step_time_model.num_observations == engine.steps - stalled


def test_serve_flags_reach_the_scheduler() -> None:
    import argparse

    from batcher.engine.metrics import Metrics
    from batcher.app.serve import build_engine
    from batcher.app.serve_flags import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--model", "fake", "--slo-tpot-ms", "100",
                              "--max-step-slowdown", "2", "--min-prefill-chunk", "32",
                              "--burst-window-ms", "250"])
    engine = build_engine(args, Metrics())
    cfg = engine.scheduler.config
    assert (cfg.prefill_budget, cfg.slo_tpot_s, cfg.max_step_slowdown,
            cfg.min_prefill_chunk, cfg.burst_window_s) == ("time", 0.1, 2.0, 32, 0.25)
    assert engine.scheduler.step_time is engine.step_time_model
    fixed = build_engine(parser.parse_args(["--model", "fake", "--prefill-budget", "fixed"]),
                         Metrics())
    assert fixed.scheduler.step_time is None
    with pytest.raises(ValueError, match="max_step_slowdown"):
        build_engine(parser.parse_args(["--model", "fake", "--max-step-slowdown", "0.5"]),
                     Metrics())


def test_simulator_runs_the_same_budget() -> None:
    """A simulated replica on the calibrated CPU model reproduces the engine's budget: with the
    default target the streams' steps stay within ~1.5x steady while the prompt is read, and
    the fixed budget's steps do not."""
    from batcher.sim.engine_sim import SimReplica, run_alone
    from batcher.sim.stepmodel import load_step_model

    calibrated = load_step_model(str(Path(__file__).resolve().parent.parent
                                     / "workloads" / "step_time_cpu.json"))
    @dataclass
    class Recorder:
        steps: list[tuple[StepShape, float]] = field(default_factory=list)

        def step_seconds(self, sched: SchedulerOutput) -> float:
            t = calibrated.step_seconds(sched)
            self.steps.append((StepShape.of(sched, BS), t))
            return t

    worst = {}
    for mode in ("time", "fixed"):
        recorder = Recorder()
        steps = recorder.steps
        rep = SimReplica(0, SchedulerConfig(64, 320, 4096, prefill_budget=mode), 4096, BS,
                         recorder)
        sp = SamplingParams(max_tokens=200, ignore_eos=True)
        arrivals = [(0.0, Request(f"s{i}", [10 + i] * 100, sp)) for i in range(8)]
        arrivals.append((2.0, Request("long", [11] * 2000, SamplingParams(max_tokens=2))))
        run_alone(rep, arrivals)
        assert rep.step_time_model.num_observations == len(steps)
        # The long prompt's chunks, next to the 8 streams' decodes.
        worst[mode] = max(t / calibrated.shape_seconds(sh.decode_only)
                          for sh, t in steps if sh.prefill_tokens and sh.decode_rows == 8)
    assert worst["time"] <= 1.5 * 1.1
    assert worst["fixed"] > 4


def burst(mode: str, n: int = 32) -> tuple[float, float]:
    """chat64's first `n` requests all at t=0: (makespan, median TTFT) on the simulated clock."""
    from batcher.bench.common import load_workload

    sim = Sim(SchedulerConfig(64, 320, 4096, prefill_budget=mode))
    work = load_workload(None, n)
    for r in work:
        sim.add(r["id"], len(r["prompt_ids"]), r["max_new_tokens"])
    sim.run_until(lambda: not sim.sched.has_unfinished(), limit=20_000)
    ttfts = sorted(t[0] for t in sim.token_times.values())
    return sim.now, ttfts[len(ttfts) // 2]


def test_a_burst_of_arrivals_keeps_its_throughput() -> None:
    """Many requests at once: the streams' steady step is that of the batch they are about to
    share, so the budget does not starve the queue to shield the first few streams."""
    fixed_wall, fixed_ttft = burst("fixed")
    time_wall, time_ttft = burst("time")
    assert time_wall <= 1.05 * fixed_wall
    assert time_ttft <= 1.5 * fixed_ttft


def test_a_burst_fills_its_batch_at_the_whole_budget_then_keeps_the_target() -> None:
    sim = Sim(SchedulerConfig(64, 320, 4096))
    for i in range(24):
        sim.add(f"b{i}", 200, 100)
    sim.run_until(lambda: not sim.sched.waiting)
    # While any of the burst waited to start, every step carried the whole budget.
    fill = [out for out, _, target in sim.steps if target is None]
    assert len(fill) >= 8
    assert all(sum(len(s.token_ids) for s in out.seqs) == 320 for out in fill[:-1])
    sim.run_until(lambda: not sim.sched.has_unfinished(), limit=20_000)
    # Once all of it has started, the streams' target applies again.
    assert any(t is not None for _, _, t in sim.steps)


def test_a_pair_arriving_together_is_not_a_burst() -> None:
    sim = Sim(SchedulerConfig(64, 320, 4096))
    sim.add("short", 50, 200)
    sim.add("long", 2000, 2)
    sim.run_until(lambda: bool(sim.token_times["long"]))
    # the short one's stream keeps its target while the long prompt is read
    assert all(t is not None for out, _, t in sim.steps if any(s.is_decode for s in out.seqs))


def test_streams_running_before_a_burst_keep_their_target() -> None:
    sim = Sim(SchedulerConfig(64, 320, 4096))
    for i in range(8):
        sim.add(f"s{i}", 100, 400)
    sim.run_until(lambda: all(len(sim.token_times[f"s{i}"]) >= 30 for i in range(8)))
    arrival = len(sim.steps)
    for i in range(24):  # more than decode, all at once: but not with the streams
        sim.add(f"b{i}", 200, 50)
    sim.run_until(lambda: not sim.sched.waiting)
    assert all(t is not None for _, _, t in sim.steps[arrival:])
    off = Sim(SchedulerConfig(64, 320, 4096, burst_window_s=0))
    for i in range(24):
        off.add(f"b{i}", 200, 100)
    off.run_until(lambda: not off.sched.waiting)
    # With the window off, every step carrying a decode has the streams' target.
    assert all(t is not None for out, _, t in off.steps if any(s.is_decode for s in out.seqs))


@pytest.mark.parametrize("seed", [5, 8])
def test_noisy_steps_stay_within_the_target_at_a_high_quantile_not_only_on_average(
        seed: int) -> None:
    """Step times scatter around any fit (on a shared CPU by ~5%, with rare steps 10-15% over).
    Sized to the target itself, about half the mixed steps would run over it; sized to the
    target over the 90th percentile of the fit's recent overrun, 4-10% still do; over the 99th,
    at most 2% do, and the prompt still moves every step."""
    import random

    rng = random.Random(seed)

    def noisy(shape: StepShape) -> float:
        return cpu_like(shape) * rng.lognormvariate(0.0, 0.06)

    sim = Sim(SchedulerConfig(64, 320, 4096), formula=noisy, context_read_s=2e-3)
    arrival = streams_then_long_prompt(sim)
    mixed = [(out, t, target) for out, t, target in sim.steps[arrival:] if target is not None]
    assert all(prefill_of(out, "long") >= 2 for out, _, _ in mixed[:-1])  # the last: the rest
    # Steps whose chunk the target sized (more than the minimum chunk, which a step gets even
    # when nothing fits): 0-1.9% over it here (seeds 5-12), 4-10% at the 90th percentile.
    sized = [(seconds, target) for out, seconds, target in mixed if prefill_of(out, "long") > 2]
    over = sum(seconds > target for seconds, target in sized)
    assert len(sized) > 30 and over <= 0.025 * len(sized), (over, len(sized))
    assert 1.0 < sim.model.overrun() <= 1.5


def test_overrun_is_a_quantile_of_recent_steps_with_decodes() -> None:
    model = OnlineStepTimeModel()
    decode = StepShape(8, 256)
    mixed = decode.plus(32, 500)
    for _ in range(7):
        model.observe(mixed, 1.2 * model.predict(mixed))
    assert model.overrun() == 1.0  # too few seen yet
    for _ in range(40):
        model.observe(mixed, 1.2 * model.predict(mixed))
    assert 1.05 < model.overrun() <= 1.2  # the fit catches up, the ratios shrink
    for _ in range(80):
        model.observe(mixed, 5 * model.predict(mixed))
    assert model.overrun() == 1.5  # capped: past it the fit itself must follow
    # Decode-only steps sample the machine's scatter too: a window of them sets the margin the
    # first chunks after a quiet spell get; a prefill-only step (no target applies) does not.
    for _ in range(200):
        model.observe(decode, 1.1 * model.predict(decode))
        model.observe(StepShape().plus(64, 0), 3.0)
    assert 1.0 < model.overrun() <= 1.1


def test_one_slow_step_does_not_set_the_margin_two_do() -> None:
    """The overrun is a high quantile of recent steps but never the single largest: one stall
    would otherwise shrink every chunk for the next hundred steps."""
    model = OnlineStepTimeModel()
    mixed = StepShape(8, 256).plus(32, 500)
    for _ in range(40):
        model.observe(mixed, model.predict(mixed))
    assert model.overrun() < 1.02
    model.observe(mixed, 1.4 * model.predict(mixed))
    assert model.overrun() < 1.02
    model.observe(mixed, 1.4 * model.predict(mixed))
    # Two do, measured against the fit as it is after them (it has moved toward them).
    assert model.overrun() > 1.1


def row_priced(shape: StepShape) -> float:
    """As measured on the bundled model on one CPU thread: a step's fixed cost is most of it,
    and a prefill token costs as much as a decode row."""
    return 0.04 + 4e-3 * (shape.decode_rows + shape.prefill_tokens) + 0.3 * shape.prefill_attn / 1e6


def short_prompt_beside_streams(slo_ttft_s: float | None) -> tuple[Sim, float]:
    """Two streams decode, then a 150-token prompt arrives; returns the sim and its TTFT."""
    sim = Sim(SchedulerConfig(64, 320, 4096, slo_ttft_s=slo_ttft_s), formula=row_priced)
    for i in range(2):
        sim.add(f"s{i}", 100, 400)
    sim.run_until(lambda: all(len(sim.token_times[f"s{i}"]) >= 60 for i in range(2)))
    sim.add("short", 150, 2)
    arrival = sim.now
    sim.run_until(lambda: bool(sim.token_times["short"]))
    return sim, sim.token_times["short"][0] - arrival


def test_a_first_token_is_paced_to_the_ttft_slo() -> None:
    """Beside two streams the time target leaves a short prompt a few tokens a step, and its
    first token comes after seconds; under a TTFT SLO it comes within the SLO."""
    _, ttft_unpaced = short_prompt_beside_streams(None)
    sim, ttft = short_prompt_beside_streams(1.0)
    assert ttft_unpaced > 1.0, ttft_unpaced  # the case pacing exists for
    # Paced to half the SLO; the step-time model, fitted on decode steps so far, underprices
    # the first chunks, and the other half of the SLO is the margin for that.
    assert ttft <= 1.0 and ttft < 0.4 * ttft_unpaced, (ttft, ttft_unpaced)
    # The streams still decode every step while it is read.
    last = sim.token_times["s0"]
    assert all(b - a < 0.5 for a, b in itertools.pairwise(last))


def test_a_prompt_late_even_at_the_whole_budget_keeps_the_streams_target() -> None:
    """A 2000-token prompt cannot be read within a 0.3 s SLO whatever it is given: pacing it
    would stall the streams for a first token that misses anyway, so they keep their target."""
    sim = Sim(SchedulerConfig(64, 320, 4096, slo_ttft_s=0.3))
    arrival = streams_then_long_prompt(sim)
    mixed = [(out, t) for out, t, _ in sim.steps[arrival:] if prefill_of(out, "long") > 0]
    assert len(mixed) == len(sim.steps[arrival:]) > 8  # small chunks, one every step
    for out, seconds in mixed:
        streams = [s for s in out.seqs if s.is_decode and s.request_id != "long"]
        steady = sim.steady(8, max(s.start_pos + 1 for s in streams))
        assert seconds <= 1.5 * steady * 1.1, (seconds, steady)


def test_batch_priority_is_not_paced() -> None:
    sim = Sim(SchedulerConfig(64, 320, 4096, slo_ttft_s=1.0), formula=row_priced)
    for i in range(2):
        sim.add(f"s{i}", 100, 400)
    sim.run_until(lambda: all(len(sim.token_times[f"s{i}"]) >= 60 for i in range(2)))
    ids = [(i * 31) % 4000 + 10 for i in range(150)]
    req = Request("b", ids, SamplingParams(max_tokens=2, ignore_eos=True), arrival_time=sim.now,
                  priority=Priority.BATCH)
    sim.sched.add_request(req)
    sim.token_times["b"] = []
    arrival = sim.now
    sim.run_until(lambda: bool(sim.token_times["b"]))
    _, ttft_unpaced = short_prompt_beside_streams(None)
    assert sim.now - arrival == pytest.approx(ttft_unpaced, rel=0.2)


def test_the_margin_returns_once_the_fit_has_learned_a_slower_machine() -> None:
    """Every step suddenly twice as slow: the fit takes a few steps to follow, and those steps
    ran up to 2x over what it predicted then. Against the fit as it is now they are ordinary,
    so the margin does not stay at its cap for a whole window after the fit caught up."""
    model = OnlineStepTimeModel()
    mixed = StepShape(8, 256).plus(32, 500)
    truth = model.predict(mixed)
    for _ in range(60):
        model.observe(mixed, truth)
    assert model.overrun() < 1.02
    for _ in range(30):
        model.observe(mixed, 2 * truth)
    assert abs(model.predict(mixed) / (2 * truth) - 1) < 0.05  # the fit has followed
    assert model.overrun() < 1.1


def test_a_step_of_decodes_alone_is_not_paced_and_a_waiting_prompt_is() -> None:
    """With every row a decode and nothing waiting there is no chunk to size: the step skips
    the allowance (its prediction and margin, per step); a prompt arriving brings it back."""
    sim = Sim(SchedulerConfig(64, 320, 4096))
    for i in range(4):
        sim.add(f"s{i}", 40, 500)
    sim.run_until(lambda: all(sim.token_times[f"s{i}"] for i in range(4)))
    t0 = sim.now
    while sim.now < t0 + 1.5:  # past the burst window: the next arrival is no burst
        out = sim.step()
        assert all(s.is_decode for s in out.seqs) and sim.sched.last_allowance is None
    sim.add("late", 600, 2)
    out = sim.step()
    assert sim.sched.last_allowance is not None
    assert 0 < prefill_of(out, "late") < 320  # paced beside the four streams
