"""The engine's step overlap: each step launched before the last one's tokens are emitted, or
after; and in steady decoding, the step after it queued before its tokens are known.

    python -m scripts.bench overlap [--streams 64,256] [--device-step-ms 2] [--model-requests 32]
        [--rounds 3] [--checkout LABEL=DIR] [--no-append]

One process, the engine built as `batcher serve` builds it (`build_engine` with the default
`EngineConfig`, on uvloop where it is installed), a fresh engine each run, its loop in three
modes, in a rotated order every round:

- `ahead` (the default): each step launched before the last one's tokens are emitted, and in
  steady decoding the step after it scheduled ahead (`Scheduler.schedule_ahead`);
- `overlap`: launched before emitting, never scheduled ahead;
- `off` (`--no-step-overlap`): emit, then schedule and launch.

Models:
- a device-like model: `--model fake` whose every step costs `--device-step-ms` and nothing per
  row, as a GPU step that the host only waits for; N streams of 128-token prompts and 256-token
  answers, all at t=0. The host's work (scheduling, detokenizing, pushing to streams) is what the
  modes hide or not.
- the same fake model on a device that queues steps as a GPU's stream does
  (`FakeDevice(queued=True)`, `QueuedFakeRunner`), in two modes: `ahead` (the default: each
  step launched on the model thread and its tokens read back on the engine's reader thread, so
  the model thread launches a step queued ahead while the device still runs the one before, as
  the real runner on CUDA does) and `ahead, read on the model thread`
  (`ModelSteps.read_apart = False`: the model thread runs each step to its end, then launches
  the next).
- the bundled model at the defaults on this machine's CPU: the first `--model-requests` requests
  of the chat workload, greedy, all at t=0 (whether the host's work, now beside the model's
  threads, costs the model anything), in the three modes and read on the model thread.

Each row: output tokens a second, time per output token, steps, and the host's wall time per
step beyond the device's (fake model only). These requests end at their length, so no step holds
a row of a request that had already ended (what a stop string matched on text costs: one row,
dropped).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from batcher.bench.common import append_rows, load_workload, pct
from batcher.bench.workload import synthetic
from batcher.bundled import DEFAULT_MODEL
from batcher.core.request import Request
from batcher.core.sampling import SamplingParams
from batcher.engine.config import EngineConfig
from batcher.engine.factory import build_engine
from batcher.engine.fake_runner import FakeDevice, FakeSpeed
from batcher.http.listener import run_event_loop
from scripts.bench._shared import parser

HEADER = ["model", "streams", "mode", "output tok/s", "TPOT p50 / p99 ms", "steps",
          "ms / step", "host ms / step beyond the device", "ok"]


# mode: (overlap, ahead, tokens read back apart from the launch)
MODES = {"ahead": (True, True, True), "overlap": (True, False, True),
         "off": (False, False, True), "joined": (True, True, False)}
MODE_LABELS = {"ahead": "ahead (default)", "overlap": "overlap, never ahead",
               "off": "off (emit first)", "joined": "ahead, read on the model thread"}


async def run_once(engine, work: list[tuple[str, list[int], int]], mode: str | None) -> dict:
    """Every request at t=0 through `engine` (fresh, started here, stopped after), in `mode`
    (None: as built, whatever its code's defaults are)."""
    if mode is not None:
        engine.overlap, engine.ahead, engine.model_steps.read_apart = MODES[mode]
    await engine.start()
    warm = Request("warm", [1000, 1001, 1002, 1003], SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True))
    async for _ in engine.generate(warm):
        pass
    tpots: list[float] = []
    ok = 0
    steps0 = engine.steps
    t0 = time.perf_counter()

    async def one(rid: str, ids: list[int], n: int) -> None:
        nonlocal ok
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        got, first, last = 0, None, None
        async for ev in engine.generate(Request(rid, ids, sp)):
            got += len(ev.token_ids)
            now = time.perf_counter()
            first = now if first is None else first
            last = now
        ok += got == n
        if got > 1:
            tpots.append((last - first) / (got - 1) * 1000)

    await asyncio.gather(*(one(*w) for w in work))
    wall = time.perf_counter() - t0
    steps = engine.steps - steps0
    await engine.stop()
    tokens = sum(n for _, _, n in work)
    return {"tok_s": tokens / wall, "tpot50": pct(tpots, 50), "tpot99": pct(tpots, 99),
            "steps": steps, "ms_step": wall / steps * 1000, "ok": ok, "n": len(work)}


def median_row(runs: list[dict]) -> dict:
    keys = ("tok_s", "tpot50", "tpot99", "steps", "ms_step")
    row = {k: statistics.median(r[k] for r in runs) for k in keys}
    row["ok"], row["n"] = min(r["ok"] for r in runs), runs[0]["n"]
    return row


def fake_cases(streams: str, device_step_ms: float, queued: bool = True) -> list[tuple]:
    """(label, streams, engine factory, work, modes) for the device-like fake model, and with
    `queued` the same on a device that queues steps."""
    speed = FakeSpeed(prefill_tokens_per_s=float("inf"), decode_step_s=device_step_ms / 1000,
                      per_seq_s=0.0)
    devices = [(f"fake, {device_step_ms:g} ms a step", FakeDevice(speed),
                ["ahead", "overlap", "off"])]
    if queued:
        devices.append((f"fake, {device_step_ms:g} ms a step, queued device",
                        FakeDevice(speed, queued=True), ["ahead", "joined"]))
    cases = []
    for n in [int(x) for x in streams.split(",") if x]:
        work = [(r.id, r.prompt_ids, 256) for r in synthetic(
            n, input_median=128, input_spread=0.0, output_median=256, output_spread=0.0)]
        for label, device, modes in devices:
            cases.append((label, n, lambda device=device: build_engine(
                "fake", EngineConfig(), fake=device), work, modes))
    return cases


def run_checkout(checkout: Path, streams: str, device_step_ms: float) -> dict[int, dict]:
    """One run of each fake case, at its defaults, by the code of another checkout (this file,
    run in a process of its own with that checkout alone on its path); by stream count."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    # NOTE: `-c`, not the file's path: a script's own folder would come first on the path.
    run = (f"import runpy, sys; sys.argv = ['overlap', '--child', '--streams', {streams!r}, "
           f"'--device-step-ms', '{device_step_ms}']; "
           f"runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", run], cwd=checkout, env=env,
                         capture_output=True, text=True, check=True, timeout=1800)
    return {r["streams"]: r for r in map(json.loads, filter(str.strip, out.stdout.splitlines()))}


def child(streams: str, device_step_ms: float) -> None:
    # NOTE: another checkout's code may have no queued fake device.
    for _, n, make, work, _ in fake_cases(streams, device_step_ms, queued=False):
        r = run_event_loop(run_once(make(), work, None))
        print(json.dumps({**r, "streams": n}), flush=True)


def row(label: str, n: int, mode: str, runs: list[dict], device_step_ms: float) -> list[str]:
    m = median_row(runs)
    beyond = f"{m['ms_step'] - device_step_ms:.2f}" if label.startswith("fake") else "—"
    return [label, str(n), mode, f"{m['tok_s']:,.0f}", f"{m['tpot50']:.2f} / {m['tpot99']:.2f}",
            f"{m['steps']:.0f}", f"{m['ms_step']:.2f}", beyond, f"{m['ok']}/{m['n']}"]


def main(argv: list[str]) -> None:
    ap = parser(__name__, __doc__, raw=True)
    ap.add_argument("--streams", default="64,256", help="fake-model stream counts; '' for none")
    ap.add_argument("--device-step-ms", type=float, default=2.0)
    ap.add_argument("--model-requests", type=int, default=32,
                    help="bundled-model requests (0 for none)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--checkout", action="append", default=[], metavar="LABEL=DIR",
                    help="also run the fake cases at the defaults of another checkout's code "
                    "(e.g. a `git worktree` of an older commit), in every round")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args(argv)
    if args.child:
        child(args.streams, args.device_step_ms)
        return
    checkouts = [(label, Path(d)) for label, _, d in (c.partition("=") for c in args.checkout)]

    cases = fake_cases(args.streams, args.device_step_ms)
    if args.model_requests:
        chat = load_workload(None, args.model_requests)
        work = [(r["id"], r["prompt_ids"], r["max_new_tokens"]) for r in chat]
        cases.append((f"{DEFAULT_MODEL}, defaults", len(work),
                      lambda: build_engine(DEFAULT_MODEL, EngineConfig()), work,
                      ["ahead", "overlap", "off", "joined"]))

    runs: dict[tuple[str, int, str], list[dict]] = {}

    def run_checkouts() -> None:
        for label, d in checkouts:
            for n, r in run_checkout(d, args.streams, args.device_step_ms).items():
                runs.setdefault(("checkout", n, label), []).append(r)

    for rnd in range(args.rounds):
        if rnd % 2:  # the other checkouts first in odd rounds, last in even ones
            run_checkouts()
        for i, (label, n, make, work, order) in enumerate(cases):
            k = rnd % len(order)
            for mode in order[k:] + order[:k]:
                r = run_event_loop(run_once(make(), work, mode))
                print(label, n, mode, r, flush=True)
                runs.setdefault(("mode", i, mode), []).append(r)
        if not rnd % 2:
            run_checkouts()
    rows = []
    for i, (label, n, _, _, modes) in enumerate(cases):
        rows += [row(label, n, MODE_LABELS[mode], runs[("mode", i, mode)], args.device_step_ms)
                 for mode in modes]
        if label.startswith("fake") and "queued" not in label:
            rows += [row(label, n, f"checkout {c}, its defaults", runs[("checkout", n, c)],
                         args.device_step_ms) for c, _ in checkouts]
    if args.no_append:
        for r in rows:
            print(" | ".join(r))
        return
    print(append_rows(
        "Step overlap: each step launched before or after the last one's tokens are emitted, "
        "and scheduled ahead of them or not, one process, rotated (scripts/bench/overlap.py)",
        HEADER, rows,
        notes=f"Medians of {args.rounds} rounds each; every request at t=0 to a fresh engine "
        "after one 4-token warm-up request; TPOT per stream from its first to its last event; "
        "ms / step is the run's wall time over the engine's steps." + (
            " A checkout's rows: this file run by that checkout's code (`--checkout`), in a "
            "process of its own, in the same rounds." if checkouts else "")))


if __name__ == "__main__":  # as a checkout's child process (`--checkout`)
    main(sys.argv[1:])
