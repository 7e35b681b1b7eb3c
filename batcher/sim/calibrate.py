"""`batcher sim calibrate`: time the real ModelRunner over a grid of step compositions and fit a
step-time model (see `stepmodel.py`) to the measurements.

Each grid point is a hand-built `SchedulerOutput` (decodes at a context length, prefill chunks at
a start position, or both), run `reps` times in each of `rounds` shuffled passes after one
warm-up; the fastest run is the sample (see `measure`). The fit is scored on the samples (R^2,
mean absolute % error) and by 5-fold cross-validation (the error on points it did not see).

Torch is imported only here and in `validate.py`; the simulator itself never needs it.
"""

from __future__ import annotations

import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from batcher.core.outputs import ScheduledSeq, SchedulerOutput
from batcher.core.step_time import StepShape
from batcher.core.sampling import SamplingParams
from batcher.sim.stepmodel import (
    DEFAULT_KNOT,
    LinearStepModel,
    StepModel,
    fit_linear,
    fit_quality,
)

GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@dataclass(slots=True, frozen=True)
class Point:
    """One step composition: `n_dec` decodes at context `ctx`, plus `chunks` prefill chunks of
    `chunk` tokens each starting at position `start`."""

    n_dec: int = 0
    ctx: int = 0
    chunks: int = 0
    chunk: int = 0
    start: int = 0

    def label(self) -> str:
        parts = []
        if self.n_dec:
            parts.append(f"{self.n_dec} dec @ {self.ctx}")
        if self.chunks:
            parts.append(f"{self.chunks} x {self.chunk} prefill @ {self.start}")
        return " + ".join(parts)


def default_grid(quick: bool = False) -> list[Point]:
    """About 55 points (about 12 with `quick`) spanning the CPU engine's step shapes: up to 64
    decodes, chunks up to the 320-token budget, contexts up to ~700, and short chunks at 1-2k
    tokens of context."""
    if quick:
        return ([Point(n, c) for n in (1, 16, 64) for c in (64, 512)]
                + [Point(chunks=1, chunk=c) for c in (32, 320)]
                + [Point(n, 256, 1, 128) for n in (8, 32)])
    grid = [Point(n, c) for n in (1, 4, 8, 16, 32, 48, 64) for c in (64, 256, 704)]
    grid += [Point(chunks=1, chunk=c, start=s) for c in (16, 64, 128, 256, 320) for s in (0, 256)]
    grid += [Point(n, 256, 1, c) for n in (4, 16, 32, 60) for c in (32, 128, 256)]
    grid += [Point(8, 128, 2, 128), Point(0, 0, 4, 64), Point(16, 512, 1, 256, 384)]
    # Short chunks deep into a long prompt next to decodes: what a chunk's context read costs.
    grid += [Point(8, 128, 1, c, s) for c in (4, 32) for s in (1024, 2000)]
    return grid


def build_step(p: Point, num_blocks: int, block_size: int) -> SchedulerOutput:
    """A `SchedulerOutput` with this composition. Block ids wrap around the pool (sharing
    blocks changes what is read, not how long it takes)."""
    seqs: list[ScheduledSeq] = []
    nxt = 0

    def blocks(n_tokens: int) -> list[int]:
        nonlocal nxt
        n = -(-n_tokens // block_size)
        ids = [(nxt + i) % num_blocks for i in range(n)]
        nxt = (nxt + n) % num_blocks
        return ids

    for i in range(p.n_dec):
        seqs.append(ScheduledSeq(f"d{i}", [1000 + i], p.ctx - 1, blocks(p.ctx), True, GREEDY,
                                 output_index=1))
    for i in range(p.chunks):
        end = p.start + p.chunk
        seqs.append(ScheduledSeq(f"p{i}", [2000 + j % 5000 for j in range(p.chunk)], p.start,
                                 blocks(end), True, GREEDY))
    return SchedulerOutput(seqs=seqs)



def rates_from_model(model: StepModel, slots: int, ctx: int, chunk: int = 320
                     ) -> tuple[float, float]:
    """(prefill tokens/s with `chunk`-token chunks, decode tokens/s with `slots` decodes at
    context `ctx`) of a step model: the replica figures `batcher plan` takes."""
    pre = model.step_seconds(build_step(Point(chunks=1, chunk=chunk), 1 << 20, 16))
    dec = model.step_seconds(build_step(Point(slots, ctx), 1 << 20, 16))
    return chunk / pre, slots / dec


def measure(runner, points: list[Point], reps: int, rounds: int = 3, seed: int = 0,
            log=print) -> list[tuple[Point, float]]:
    """Seconds of `runner.execute` per point: every point is run once to warm up, then
    `rounds` passes in fresh shuffled orders run each point `reps` times; the sample is the
    fastest of its runs. On a machine shared with other work a run can take 10-100x its
    quiet time, so the minimum (the step with the cores to itself) is the stable statistic; the
    cost of sharing is left to the validation, which measures the real engine as it runs."""
    steps = {p: build_step(p, runner.num_blocks, runner.block_size) for p in points}
    for p in points:
        runner.execute(steps[p])  # warm-up: buffers sized, caches touched
    times: dict[Point, list[float]] = {p: [] for p in points}
    rng = random.Random(seed)
    for r in range(rounds):
        order = list(points)
        rng.shuffle(order)
        for p in order:
            for _ in range(reps):
                t0 = time.perf_counter()
                runner.execute(steps[p])
                times[p].append(time.perf_counter() - t0)
        log(f"round {r + 1}/{rounds} done")
    out = [(p, min(times[p])) for p in points]
    for p, best in out:
        med = statistics.median(times[p])
        log(f"{p.label():<36} {best * 1e3:8.1f} ms  (median {med * 1e3:.1f} ms)")
    return out


def wait_quiet(max_load: float = 1.0, timeout: float = 300.0, log=print) -> float:
    """Wait (up to `timeout` s) until the 1-minute load average is below `max_load`, so timing
    runs do not share the cores with other work; returns the load average at the start."""
    deadline = time.monotonic() + timeout
    while True:
        with open("/proc/loadavg") as f:
            load = float(f.read().split()[0])
        if load < max_load or time.monotonic() > deadline:
            return load
        log(f"load average {load:.2f} >= {max_load}: waiting for a quiet machine")
        time.sleep(15)


def rows_of(samples: list[tuple[Point, float]], block_size: int, knot: int) -> list[list[float]]:
    """Feature rows of measured points, read through the same `StepShape` the engine uses."""
    return [StepShape.of(build_step(p, 1 << 30, block_size), block_size).features(knot)
            for p, _ in samples]


def cross_validated_mape(rows: list[list[float]], ys: list[float], knot: int, folds: int = 5,
                         seed: int = 0) -> float:
    """Mean absolute % error on held-out points (k-fold)."""
    idx = list(range(len(ys)))
    random.Random(seed).shuffle(idx)
    errs: list[float] = []
    for f in range(folds):
        test = set(idx[f::folds])
        train = [i for i in idx if i not in test]
        m = fit_linear([rows[i] for i in train], [ys[i] for i in train], knot)
        errs += [abs(m.predict_row(rows[i]) - ys[i]) / ys[i] for i in test]
    return sum(errs) / len(errs)


def fit_samples(samples: list[tuple[Point, float]], block_size: int = 16,
                knots: tuple[int, ...] = (32, DEFAULT_KNOT, 96, 128, 192)) -> LinearStepModel:
    """The best fit over a few hinge knots (by in-sample mean abs % error), with its quality and
    cross-validated error in `meta`. Points the first fit misses by more than 4x its median
    error (and 25%) are dropped as disturbed measurements, at most a tenth of them, and listed
    in `meta["outliers"]`; the quality is reported with and without them."""
    ys = [s for _, s in samples]
    keep = list(range(len(samples)))
    best: tuple[float, LinearStepModel, list[list[float]]] | None = None
    for attempt in range(2):
        best = None
        for knot in knots:
            rows = rows_of(samples, block_size, knot)
            m = fit_linear([rows[i] for i in keep], [ys[i] for i in keep], knot, block_size)
            q = fit_quality(m, [rows[i] for i in keep], [ys[i] for i in keep])
            if best is None or q["mape"] < best[0]:
                best = (q["mape"], m, rows)
        assert best is not None
        if attempt:
            break
        _, m, rows = best
        err = sorted((abs(m.predict_row(rows[i]) - ys[i]) / ys[i], i) for i in keep)
        cut = max(0.25, 4 * statistics.median(e for e, _ in err))
        bad = [i for e, i in err[-max(1, len(err) // 10):] if e > cut]
        if not bad:
            break
        keep = [i for i in keep if i not in bad]
    _, model, rows = best
    q = fit_quality(model, [rows[i] for i in keep], [ys[i] for i in keep])
    model.meta.update({k: round(v, 4) for k, v in q.items()})
    q_all = fit_quality(model, rows, ys)
    model.meta["r2_all"] = round(q_all["r2"], 4)
    model.meta["mape_all"] = round(q_all["mape"], 4)
    model.meta["cv_mape"] = round(cross_validated_mape(
        [rows[i] for i in keep], [ys[i] for i in keep], model.knot), 4)
    model.meta["outliers"] = [samples[i][0].label() for i in range(len(samples))
                              if i not in keep]
    model.meta["samples"] = [[p.n_dec, p.ctx, p.chunks, p.chunk, p.start, round(s, 5)]
                             for p, s in samples]
    return model


def _measure_in_thread(runner, points: list[Point], reps: int, rounds: int, log
                       ) -> list[tuple[Point, float]]:
    import torch

    with torch.inference_mode():
        return measure(runner, points, reps, rounds, log=log)


def run_calibration(out_path: str, reps: int = 3, rounds: int = 3, quick: bool = False,
                    dtype: str = "bfloat16",
                    num_blocks: int = 3072, block_size: int = 16, threads: int | None = None,
                    quiet: bool = True, log=print) -> LinearStepModel:
    """Load the bundled model on the CPU, measure the grid, fit, save JSON to `out_path`."""
    import torch

    from batcher.bench.common import machine
    from batcher.models.loader import load_model
    from batcher.runtime.model_runner import ModelRunner

    if threads:
        torch.set_num_threads(threads)
    load0 = wait_quiet(log=log) if quiet else float("nan")
    loaded = load_model("smollm2-135m", dtype=dtype, device="cpu")
    runner = ModelRunner(loaded, num_blocks, block_size)
    t0 = time.perf_counter()
    # NOTE: the engine runs the model in one worker thread, and on this CPU a step run from a
    # second thread is ~10 ms slower than from the main thread (two OpenMP thread teams share
    # two cores); measure where the engine runs it.
    with ThreadPoolExecutor(1) as pool:
        samples = pool.submit(_measure_in_thread, runner, default_grid(quick), reps, rounds,
                              log).result()
    model = fit_samples(samples, block_size)
    model.meta.update({"model": "smollm2-135m", "dtype": dtype, "device": "cpu",
                       "machine": machine(), "threads": runner.max_threads,
                       # rows -> the thread count the steps settled on (tuned as the engine does)
                       "threads_by_rows": runner.tuner.chosen() if runner.tuner else {},
                       "reps": reps, "rounds": rounds, "load_avg_start": load0,
                       "measure_seconds": round(time.perf_counter() - t0, 1),
                       "date": time.strftime("%Y-%m-%d %H:%M")})
    model.save(out_path)
    return model
