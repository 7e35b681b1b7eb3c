"""`batcher sim validate`: the simulator against the real engine on one replica.

The same workload (a workload file, all at t = 0 or Poisson at a rate) runs twice: through the
real AsyncEngine with the bundled model (in-process, bf16, CPU), and through one `SimReplica`
(the same scheduler configuration and KV pool) with the fitted step-time model. Both report
TTFT per request (arrival to first token) and TPOT per request ((last - first token) /
(tokens - 1)); the comparison is p50 and p90 of each, and the wall time of the run.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from batcher.bench.common import load_workload, pct
from batcher.core.config import SchedulerConfig
from batcher.core.request import Request
from batcher.core.sampling import SamplingParams
from batcher.sim.engine_sim import SimReplica, run_alone
from batcher.sim.stepmodel import StepModel


@dataclass(slots=True)
class RunStats:
    ttft: list[float]
    tpot: list[float]
    wall: float
    preemptions: int
    slowdown: float = 1.0  # real runs: sum of step times / what the step model predicts

    def row(self) -> dict[str, float]:
        return {"ttft_p50": pct(self.ttft, 50), "ttft_p90": pct(self.ttft, 90),
                "tpot_p50": pct(self.tpot, 50), "tpot_p90": pct(self.tpot, 90),
                "wall": self.wall}


def offsets(n: int, rate: float | None, seed: int = 0) -> list[float]:
    """Arrival offsets: all at 0, or Poisson at `rate` (seeded)."""
    if not rate:
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def _request(r: dict, rid: str, arrival: float = 0.0) -> Request:
    sp = SamplingParams(max_tokens=r["max_new_tokens"], temperature=0.0, ignore_eos=True)
    return Request(rid, list(r["prompt_ids"]), sp, arrival_time=arrival)


def simulate(work: list[dict], times: list[float], model: StepModel, sched: SchedulerConfig,
             num_blocks: int, block_size: int = 16) -> RunStats:
    """The workload on one simulated replica."""
    rep = SimReplica(0, sched, num_blocks, block_size, model)
    done = run_alone(rep, [(t, _request(r, r["id"], t)) for t, r in zip(times, work,
                                                                         strict=True)])
    ttft = [t.first_token - t.arrival for t in done if t.first_token is not None]
    tpot = [x for t in done if (x := t.tpot) is not None]
    end = max((t.finished or 0.0) for t in done)
    return RunStats(ttft, tpot, end, rep.scheduler.stats.preemptions)


async def _real(loaded, tok, work: list[dict], times: list[float], sched: SchedulerConfig,
                num_blocks: int, model: StepModel) -> RunStats:
    from batcher.core.config import CacheConfig
    from batcher.engine.engine import AsyncEngine

    engine = AsyncEngine.from_loaded(loaded, tok, sched, CacheConfig(num_blocks=num_blocks))
    steps: list[tuple[float, float]] = []  # (measured, predicted) model seconds per step
    engine.model_steps.on_step = lambda sched_out, seconds: steps.append(
        (seconds, model.step_seconds(sched_out)))
    await engine.start()
    try:
        warm = Request("warm", [1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0.0,
                                                            ignore_eos=True))
        async for _ in engine.generate(warm):
            pass
        ttft: list[float] = []
        tpot: list[float] = []
        loop = asyncio.get_running_loop()
        steps.clear()
        t0 = loop.time()

        async def one(r: dict, offset: float) -> None:
            delay = t0 + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            async for ev in engine.generate(_request(r, r["id"], time.monotonic())):
                if ev.finished:
                    if ev.ttft is not None:
                        ttft.append(ev.ttft)
                    if ev.tpot is not None:
                        tpot.append(ev.tpot)

        await asyncio.gather(*(one(r, o) for r, o in zip(work, times, strict=True)))
        wall = loop.time() - t0
        slowdown = sum(a for a, _ in steps) / sum(p for _, p in steps)
        return RunStats(ttft, tpot, wall, engine.scheduler.stats.preemptions, slowdown)
    finally:
        await engine.stop()


def measure_real(work: list[dict], times: list[float], sched: SchedulerConfig, num_blocks: int,
                 model: StepModel, runs: int = 1, dtype: str = "bfloat16") -> list[RunStats]:
    """The workload through the real engine `runs` times (loads the bundled model once)."""
    from batcher.models.loader import load_model
    from batcher.tokenizer.tokenizer import load_tokenizer

    loaded = load_model("smollm2-135m", dtype=dtype, device="cpu")
    tok = load_tokenizer(loaded.tokenizer_source)
    return [asyncio.run(_real(loaded, tok, work, times, sched, num_blocks, model))
            for _ in range(runs)]


def compare(real: RunStats, sim: RunStats) -> dict[str, float]:
    """Relative error of the simulation per metric: (sim - real) / real."""
    r, s = real.row(), sim.row()
    return {k: (s[k] - r[k]) / r[k] for k in r}


def run_validation(args) -> int:
    """`batcher sim validate`: chat64 all at t=0 (and Poisson when asked), real vs simulated.

    Per real run, two errors: the simulation as calibrated, and the simulation with every step
    scaled by that run's slowdown (its measured step times over the model's predictions for the
    same steps). Other work on a shared machine slows a real run by a factor the calibration
    cannot know; the second error is what is left once that factor is measured: the
    scheduler's dynamics and the step model's shape."""
    from batcher.bench.common import append_rows
    from batcher.sim.calibrate import wait_quiet
    from batcher.sim.stepmodel import ScaledStepModel, load_step_model

    model = load_step_model(args.step_model)
    work = load_workload(args.workload)
    sched = SchedulerConfig()
    cases = [(f"chat{len(work)}, all at t=0", None)]
    if args.poisson_rate:
        cases.append((f"chat{len(work)}, Poisson {args.poisson_rate:g}/s", args.poisson_rate))
    rows: list[list[str]] = []
    worst = [0.0, 0.0]
    for name, rate in cases:
        times = offsets(len(work), rate, seed=0)
        sim = simulate(work, times, model, sched, args.num_blocks)
        rows.append([name, "simulated", *_cells(sim.row()), "-", "-", "-"])
        load0 = wait_quiet()
        for k, real in enumerate(measure_real(work, times, sched, args.num_blocks, model,
                                              args.runs)):
            err = compare(real, sim)
            scaled = simulate(work, times, ScaledStepModel(model, real.slowdown), sched,
                              args.num_blocks)
            cor = compare(real, scaled)
            worst[0] = max(worst[0], abs(err["ttft_p50"]), abs(err["tpot_p50"]))
            worst[1] = max(worst[1], abs(cor["ttft_p50"]), abs(cor["tpot_p50"]))
            rows.append([name, f"real run {k + 1} (load avg {load0:.1f})", *_cells(real.row()),
                         f"{real.slowdown:.2f}",
                         f"{err['ttft_p50']:+.1%} / {err['tpot_p50']:+.1%}",
                         f"{cor['ttft_p50']:+.1%} / {cor['tpot_p50']:+.1%}"])
            print(" | ".join(rows[-1]), flush=True)
    meta = getattr(model, "meta", {})
    notes = (f"Step model `{args.step_model}` (fit R^2 {meta.get('r2', float('nan')):.3f}, "
             f"mean abs error {meta.get('mape', float('nan')):.1%}, measured "
             f"{meta.get('date', '?')}); scheduler defaults (64 seqs, 320-token budget), "
             f"{args.num_blocks} KV blocks. Slowdown: the real run's summed step times over the "
             "model's predictions for the same steps (other work on the two shared cores); "
             "\"scaled\" reruns the simulation with every step times that slowdown.")
    header = ["case", "run", "p50 TTFT s", "p90 TTFT s", "p50 TPOT ms", "p90 TPOT ms",
              "wall s", "slowdown", "sim err p50 TTFT / TPOT", "scaled sim err"]
    import shlex
    import sys

    argv = sys.argv[sys.argv.index("validate") + 1:] if "validate" in sys.argv else []
    command = " ".join(["batcher sim validate", *map(shlex.quote, argv)])
    text = append_rows("Simulator vs real engine, one replica", header, rows, notes,
                       command=command, path=None if not args.no_append else _devnull())
    print(text)
    print(f"worst p50 error: {worst[0]:.1%} as calibrated, {worst[1]:.1%} scaled")
    return 0


def _cells(r: dict[str, float]) -> list[str]:
    return [f"{r['ttft_p50']:.2f}", f"{r['ttft_p90']:.2f}", f"{r['tpot_p50'] * 1e3:.0f}",
            f"{r['tpot_p90'] * 1e3:.0f}", f"{r['wall']:.1f}"]


def _devnull():
    from pathlib import Path

    return Path("/dev/null")
