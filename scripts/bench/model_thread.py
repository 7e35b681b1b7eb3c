"""Batch-1 decode step time of the bundled model by the thread its torch work runs on.

Each mode in its own process (OpenMP thread teams are per process), interleaved A, B, C, A, B, C:

- main:  load and step on the main thread (a bare loop);
- split: load on one thread, step on another (the engine: it loads on an executor thread and
         steps on its model thread);
- same:  load and step on one worker thread.

Usage: python -m scripts.bench model_thread [--rounds 3] [--steps 40] [--quantization none]
Prints the best per-step milliseconds of each mode and their ratios to `main`.

`--op`: no model, one bf16 linear (1 x 576 -> 3072, a decode row's gate/up) timed on the main
thread, then on a fresh thread, then on the main thread again, in one process per OpenMP wait
policy (the environment default, PASSIVE, ACTIVE): where the stall lives, without loading.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import threading
import time

from scripts.bench._shared import parser, rerun

MODES = ("main", "split", "same")


def _one(mode: str, steps: int, quantization: str) -> float:
    import torch

    from batcher.core.outputs import ScheduledSeq, SchedulerOutput
    from batcher.core.sampling import SamplingParams
    from batcher.models.loader import load_model
    from batcher.runtime.model_runner import ModelRunner

    state: dict[str, object] = {}

    def load() -> None:
        lm = load_model("smollm2-135m", dtype="bfloat16", device="cpu",
                        quantization=quantization)
        runner = ModelRunner(lm, num_blocks=64, block_size=16)
        runner.tune_threads = False  # the thread count under test, every step
        state["runner"] = runner

    def step() -> None:
        runner = state["runner"]
        greedy = SamplingParams(temperature=0.0)
        runner.execute(SchedulerOutput([ScheduledSeq("s", list(range(100, 164)), 0,
                                                     list(range(8)), True, greedy)]))
        times = []
        for i in range(steps):
            sched = SchedulerOutput([ScheduledSeq("s", [7], 64 + i, list(range(8)), True,
                                                  greedy)])
            t0 = time.perf_counter()
            runner.execute(sched)
            times.append(time.perf_counter() - t0)
        state["ms"] = 1000 * statistics.median(times[steps // 4:])

    def on_thread(*fns) -> None:
        t = threading.Thread(target=lambda: [f() for f in fns])
        t.start()
        t.join()

    torch.set_num_threads(torch.get_num_threads())
    if mode == "main":
        load()
        step()
    elif mode == "split":
        load()
        on_thread(step)
    else:
        on_thread(load, step)
    return float(state["ms"])


def _op_run() -> None:
    import torch

    def median_us() -> float:
        a = torch.randn(1, 576, dtype=torch.bfloat16)
        w = torch.randn(3072, 576, dtype=torch.bfloat16)
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            torch.nn.functional.linear(a, w)
            times.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(times)

    first = median_us()
    box: list[float] = []
    t = threading.Thread(target=lambda: box.append(median_us()))
    t.start()
    t.join()
    print(f"{first:.0f} {box[0]:.0f} {median_us():.0f}")


def _op(rounds: int) -> None:
    import os

    for r in range(rounds):
        for policy in ("", "PASSIVE", "ACTIVE"):
            env = dict(os.environ)
            env.pop("OMP_WAIT_POLICY", None)
            if policy:
                env["OMP_WAIT_POLICY"] = policy
            out = subprocess.run(rerun(__name__, "--op-child"), env=env,
                                 capture_output=True, text=True, check=True, timeout=300)
            main_us, fresh_us, again_us = out.stdout.split()[-3:]
            print(f"round {r} wait policy {policy or 'default':8s} linear: main {main_us} us, "
                  f"fresh thread {fresh_us} us, main again {again_us} us", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")


def main(argv: list[str]) -> None:
    p = parser(__name__, __doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--quantization", default="none", choices=("none", "int8", "int4"))
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one child run
    p.add_argument("--op", action="store_true", help="time one linear by thread, no model")
    p.add_argument("--op-child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.op_child:
        _op_run()
        return
    if a.op:
        _op(a.rounds)
        return
    if a.mode:
        print(_one(a.mode, a.steps, a.quantization))
        return
    best = {m: float("inf") for m in MODES}
    for _ in range(a.rounds):
        for m in MODES:
            out = subprocess.run(rerun(__name__, "--mode", m, "--steps", str(a.steps),
                                       "--quantization", a.quantization),
                                 capture_output=True, text=True, check=True, timeout=600)
            ms = float(out.stdout.split()[-1])
            print(f"# {m} {ms:.2f} ms/step", flush=True)  # each run, as it ends
            best[m] = min(best[m], ms)
    for m in MODES:
        print(f"{m:6s} {best[m]:7.2f} ms/step  x{best[m] / best['main']:.2f} of main")

