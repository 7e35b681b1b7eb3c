"""Chunked prefill in the engine: streams beside an arriving long prompt, fixed vs time budget.

Running streams while a long prompt arrives, fixed vs time-sized prefill budget, and chat64
throughput old vs new: every case in its own process, interleaved (A, B, C, A, B, C), one run.

    python -m scripts.bench chunked_prefill [--rounds 2] [--long 2000] [--chat64 64] [--no-streams]

Part 1: 8 streams decode (the first 8 chat64 prompts, greedy, ignore_eos); once each has 30
tokens a ~2k-token prompt arrives. Per case: the streams' steady gap between tokens (median before
the arrival), their p99 and worst gap from the arrival to the long prompt's first token, and that
prompt's TTFT, and the floor under any time target: the streams' own decode-only step at the
context of the slowest steps. Cases: `--prefill-budget fixed` (the old fixed 320-token budget),
the default (`time`, 1.5x the decode-only step) and `--slo-tpot-ms 100`. `--stream-prompt N`
cuts the streams' prompts to N tokens: their decode step then stays under a TPOT SLO that
whole-prompt streams exceed on their own.
Part 2: chat64 all at t=0 through the engine (the `engine` scenario's run), fixed vs time.

`--fit-clock cpu` feeds the engine's step-time model each step's model-thread CPU seconds instead
of its wall seconds: on a machine shared with other work, a step's wall time is mostly waiting for
a core, in proportions that differ between short and long steps, so the budget would be sized for
that machine's contention; fed CPU time, it is sized as on a core of its own, which is what the CPU
columns measure.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import time

from batcher.bench.common import append_rows, load_workload, pct
from batcher.engine.config import DEFAULT_SLO_TTFT_MS
from scripts.bench._shared import parser, rerun

# "time" is `batcher serve`'s default: the time budget, first tokens paced to the default TTFT SLO.
CASES = {
    "fixed": {"prefill_budget": "fixed"},
    "time": {"slo_ttft_s": DEFAULT_SLO_TTFT_MS / 1000},
    "time-slo100": {"slo_tpot_s": 0.1, "slo_ttft_s": DEFAULT_SLO_TTFT_MS / 1000},
}


def case_config(name: str) -> dict | None:
    """A case's scheduler settings: one of CASES, or `time-sloN` (`--slo-tpot-ms N`); None for
    an unknown name."""
    if name in CASES:
        return CASES[name]
    if name.startswith("time-slo") and name[8:].isdigit() and int(name[8:]) > 0:
        return {"slo_tpot_s": int(name[8:]) / 1000, "slo_ttft_s": DEFAULT_SLO_TTFT_MS / 1000}
    return None


STREAMS = 8
STEADY_TOKENS = 30
STEADY_AFTER = 15  # tokens per stream after the prompt's first token, to measure steady again


def load(dtype: str):
    from batcher.models.loader import load_model
    from batcher.tokenizer.tokenizer import load_tokenizer

    loaded = load_model("smollm2-135m", dtype=dtype, device="cpu")
    return loaded, load_tokenizer(loaded.tokenizer_source)


class CpuClock:
    """Model-thread CPU seconds of every step. With one torch thread the step's work runs on that
    thread, so this is what the step would take on a core of its own, whatever else the shared
    machine runs: the idle-machine view next to the wall-clock one."""

    def __init__(self, runner, feed=None) -> None:
        from batcher.core.step_time import StepShape

        self.steps: list[tuple[object, float]] = []
        # NOTE: the engine launches a step on the model thread (`launch`; on a CPU that is the
        # whole step) and reads its tokens back on another.
        inner = runner.launch

        def launch(sched, before=None):
            t0 = time.thread_time()
            out = inner(sched, before)
            self.steps.append((StepShape.of(sched), time.thread_time() - t0))
            return out

        runner.launch = launch
        if feed is not None:
            # The engine observes a step once its tokens are applied, while the model thread
            # may already run the next one: the newest CPU reading of a step of that shape.
            observe = feed.observe

            def observed(shape, seconds):
                cpu = next((c for s, c in reversed(self.steps) if s == shape), seconds)
                observe(shape, cpu)

            feed.observe = observed


FIT_CPU = False  # set from --fit-clock in the child process


def engine_for(loaded, tok, **sched):
    from batcher.core.config import CacheConfig, SchedulerConfig
    from batcher.engine.engine import AsyncEngine

    engine = AsyncEngine.from_loaded(loaded, tok, SchedulerConfig(**sched), CacheConfig())
    engine.cpu = CpuClock(engine.runner, engine.step_time_model if FIT_CPU else None)
    return engine


def steady_at_ctx(steps: list[tuple[object, float]]):
    """The streams' steady (decode-only) step as a function of their context: a straight line
    through their decode-only steps before the prompt arrived and after its first token (a
    decode row's cost grows with the context it reads)."""
    import numpy as np

    ctx = np.array([sh.decode_ctx for sh, _ in steps], dtype=float)
    sec = np.array([c for _, c in steps])
    if np.ptp(ctx) == 0:
        return lambda _c: float(np.median(sec))
    slope, icept = np.polyfit(ctx, sec, 1)
    return lambda c: float(icept + slope * c)


async def streams_case(loaded, tok, sched: dict, long_len: int, stream_prompt: int = 0) -> dict:
    from batcher.core.request import Request
    from batcher.core.sampling import SamplingParams

    work = load_workload()
    long_ids = [t for r in work for t in r["prompt_ids"]][:long_len]
    engine = engine_for(loaded, tok, **sched)
    await engine.start()
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    async for _ in engine.generate(Request("warm", [1, 2, 3, 4], greedy)):
        pass
    times: list[list[float]] = [[] for _ in range(STREAMS)]
    done = asyncio.Event()

    async def stream(i: int) -> None:
        sp = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
        prompt = work[i]["prompt_ids"][-stream_prompt:] if stream_prompt else work[i]["prompt_ids"]
        async for ev in engine.generate(Request(f"s{i}", prompt, sp)):
            times[i] += [time.perf_counter()] * len(ev.token_ids)
            if done.is_set() or ev.finished:
                break  # leaving aborts the stream

    tasks = [asyncio.create_task(stream(i)) for i in range(STREAMS)]
    while min(len(t) for t in times) < STEADY_TOKENS:
        await asyncio.sleep(0.005)
    steps0 = engine.steps
    cpu0 = len(engine.cpu.steps)
    arrival = time.perf_counter()
    first = None
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    async for ev in engine.generate(Request("long", long_ids, one)):
        if ev.token_ids and first is None:
            first = time.perf_counter()
    steps = engine.steps - steps0
    # The streams' contexts grow while the prompt is read (hundreds of steps under a tight
    # target), and so does their steady step: measure it again after the prompt's first token.
    counts = [len(t) for t in times]
    while min(len(t) - c for t, c in zip(times, counts)) < STEADY_AFTER:
        await asyncio.sleep(0.005)
    cpu_steps = engine.cpu.steps
    during_steps = cpu_steps[cpu0:cpu0 + steps]
    cpu_during = [c for _, c in during_steps]
    steady_before = [(sh, c) for sh, c in cpu_steps[:cpu0]
                     if sh.decode_rows == STREAMS and not sh.prefill_tokens]
    steady_after = [(sh, c) for sh, c in cpu_steps[cpu0 + steps:]
                    if sh.decode_rows == STREAMS and not sh.prefill_tokens]
    cpu_steady = [c for _, c in steady_before]
    cpu_after = [c for _, c in steady_after]
    done.set()
    await asyncio.gather(*tasks)
    model = engine.step_time_model
    await engine.stop()
    steady, during = [], []
    for t in times:
        for a, b in itertools.pairwise(t[5:]):  # the first tokens include their prefill
            if b <= arrival:
                steady.append(b - a)
            elif b <= first:
                during.append(b - a)
    base = statistics.median(steady)
    # Each step against the steady step at its streams' context: a line through the decode-only
    # steps before the prompt arrived and after its first token, read at the step's context.
    steady_at = steady_at_ctx(steady_before + steady_after)
    # The streams' context in each step: the longest decode row's, except in a step whose
    # prompt chunk was a single token (priced, and shaped, as a decode row at the prompt's
    # context): there, the step before's.
    ctxs: list[int] = []
    for sh, _ in during_steps:
        ctxs.append(sh.decode_ctx if sh.decode_rows == STREAMS or not ctxs else ctxs[-1])
    at_ctx = [c / steady_at(x) for (_, c), x in zip(during_steps, ctxs, strict=True)]
    after = statistics.median(cpu_after)
    # The floor under any time target: the streams' own decode-only step at the context of the
    # slowest steps while the prompt was read (a TPOT SLO under it cannot be met by any chunk).
    order = sorted(range(len(during_steps)), key=lambda i: during_steps[i][1])
    floor = max(steady_at(ctxs[i]) for i in order[-max(1, len(order) // 100):])
    return {"cpu_after_ms": after * 1e3, "cpu_ctx_p50_x": statistics.median(at_ctx),
            "cpu_floor_ms": floor * 1e3,
            "cpu_ctx_p99_x": pct(at_ctx, 99), "cpu_during_p99_ms": pct(cpu_during, 99) * 1e3,
            "steady_ms": base * 1e3, "steady_p99_x": pct(steady, 99) / base,
            "p50_x": statistics.median(during) / base, "p99_ms": pct(during, 99) * 1e3,
            "max_ms": max(during) * 1e3, "p99_x": pct(during, 99) / base,
            "ttft_s": first - arrival, "steps": steps, "observed": model.num_observations,
            "cpu_steady_ms": statistics.median(cpu_steady) * 1e3,
            "cpu_p50_x": statistics.median(cpu_during) / statistics.median(cpu_steady),
            "cpu_p99_x": pct(cpu_during, 99) / statistics.median(cpu_steady),
            "cpu_ttft_s": sum(cpu_during)}


async def chat64_case(loaded, tok, sched: dict, limit: int) -> dict:
    from scripts.bench import engine as bench_engine
    from scripts.bench.engine import run_engine

    clocks: list[CpuClock] = []
    build = bench_engine.AsyncEngine.from_loaded

    def from_loaded(*a, **kw):
        engine = build(*a, **kw)
        clocks.append(CpuClock(engine.runner, engine.step_time_model if FIT_CPU else None))
        return engine

    bench_engine.AsyncEngine.from_loaded = from_loaded

    args = argparse.Namespace(max_num_seqs=64, max_num_batched_tokens=320, num_blocks=None,
                              prefill_budget=sched.get("prefill_budget", "time"))
    work = load_workload(None, limit)
    out = await run_engine(loaded, tok, work, args)
    cpu = sum(c for _, c in clocks[0].steps[1:])  # the first step is the warm-up request's
    return {"tok_s": out["tok_s"], "wall_s": out["wall"], "ttft50_s": out["ttft50"],
            "p99_s": out["p99"], "exact": out["exact"],
            "cpu_tok_s": sum(r["max_new_tokens"] for r in work) / cpu}


def one(args: argparse.Namespace) -> None:
    """Child process: one case, one JSON line on stdout."""
    global FIT_CPU
    FIT_CPU = args.fit_clock == "cpu"
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    loaded, tok = load(args.dtype)
    sched = case_config(args.case)
    if args.part == "streams":
        res = asyncio.run(streams_case(loaded, tok, sched, args.long, args.stream_prompt))
    else:
        res = asyncio.run(chat64_case(loaded, tok, sched, args.chat64))
    print("RESULT " + json.dumps(res), flush=True)
    # NOTE: skip interpreter teardown: the engines' daemon model threads hold torch state, and
    # tearing it down under them can abort the process after the result is out.
    os._exit(0)


def child(args: argparse.Namespace, part: str, case: str) -> dict:
    cmd = rerun(__name__, "--one", "--part", part, "--case", case, "--long", str(args.long),
                "--chat64", str(args.chat64), "--dtype", args.dtype,
                "--fit-clock", args.fit_clock, "--stream-prompt", str(args.stream_prompt))
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    load_before = os.getloadavg()[0]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{part}/{case} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    res = json.loads(lines[-1][7:])
    res["load"] = load_before
    print(f"{part:8s} {case:12s} {res}", flush=True)
    return res


def main(argv: list[str]) -> None:
    ap = parser(__name__, __doc__, raw=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--long", type=int, default=2000, help="tokens of the arriving prompt")
    ap.add_argument("--chat64", type=int, default=64, help="chat64 requests (0: skip part 2)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--fit-clock", choices=["wall", "cpu"], default="wall",
                    help="what the engine's step-time model is fed: each step's wall seconds "
                         "(as in serving) or its model-thread CPU seconds (as on a core of its "
                         "own; for a shared machine)")
    ap.add_argument("--stream-prompt", type=int, default=0,
                    help="the streams' prompts cut to their last N tokens (0: whole, ~400): "
                         "shorter streams decode faster, so a TPOT SLO under their whole-prompt "
                         "decode step can be reached")
    ap.add_argument("--cases", default=",".join(CASES),
                    help="streams cases to run, comma-separated (fixed is the TTFT reference; "
                         "time-sloN: --slo-tpot-ms N)")
    ap.add_argument("--streams", action=argparse.BooleanOptionalAction, default=True,
                    help="part 1, the streams and the long prompt (--no-streams: chat64 only)")
    ap.add_argument("--no-append", action="store_true")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--part", default="streams", help=argparse.SUPPRESS)
    ap.add_argument("--case", default="time", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        one(args)
        return
    cases = args.cases.split(",")
    if "fixed" not in cases or any(case_config(c) is None for c in cases):
        raise SystemExit(f"--cases: a subset of {','.join(CASES)} or time-sloN (N ms) that "
                         "includes fixed")
    streams: dict[str, list[dict]] = {c: [] for c in cases}
    chat: dict[str, list[dict]] = {"fixed": [], "time": []}
    for _ in range(args.rounds):
        for case in cases if args.streams else ():
            streams[case].append(child(args, "streams", case))
        if args.chat64:
            for case, runs in chat.items():
                runs.append(child(args, "chat64", case))
    rows = []
    ref = streams["fixed"]
    for case, runs in streams.items():
        for i, r in enumerate(runs):
            rows.append([case, str(i + 1), f"{r['load']:.1f}", f"{r['steady_ms']:.0f}",
                         f"{r['steady_p99_x']:.2f}x", f"{r['p50_x']:.2f}x",
                         f"{r['p99_x']:.2f}x", f"{r['ttft_s']:.1f}",
                         f"{r['ttft_s'] / ref[i]['ttft_s']:.2f}",
                         f"{r['cpu_steady_ms']:.0f}", f"{r['cpu_p50_x']:.2f}x",
                         f"{r['cpu_p99_x']:.2f}x", f"{r['cpu_after_ms']:.0f}",
                         f"{r['cpu_ctx_p50_x']:.2f}x", f"{r['cpu_ctx_p99_x']:.2f}x",
                         f"{r['cpu_during_p99_ms']:.0f}", f"{r['cpu_floor_ms']:.0f}",
                         f"{r['cpu_ttft_s']:.1f}",
                         f"{r['cpu_ttft_s'] / ref[i]['cpu_ttft_s']:.2f}", str(r["steps"])])
    text = ""
    if rows and not args.no_append:
        text = append_rows(
            f"Chunked prefill: {STREAMS} streams"
            f"{f' (last {args.stream_prompt} prompt tokens)' if args.stream_prompt else ''}"
            f" + a {args.long}-token prompt arriving, "
            f"prefill budget fixed vs time-sized, {args.dtype}, step-time model fed "
            f"{args.fit_clock} time, interleaved",
            ["case", "round", "load avg", "wall: steady gap ms", "steady p99 / steady",
             "p50 gap / steady", "p99 gap / steady", "long TTFT s", "TTFT vs fixed",
             "CPU: steady step ms", "p50 step / steady", "p99 step / steady",
             "steady after ms", "p50 / steady at ctx", "p99 / steady at ctx", "p99 step ms",
             "decode-only floor ms", "TTFT s", "TTFT vs fixed", "steps to 1st token"], rows,
            notes="Each case in its own process, cases interleaved round by round on a machine "
                  "shared with other work (load avg at each start); ratios compare the same "
                  "round. Wall: the streams' gaps between tokens as a client sees them; steady = "
                  "their median before the prompt arrives (its own p99 / median is the shared "
                  "machine's noise floor); p50/p99 = from the prompt's arrival to its first "
                  "token. CPU: the same steps in model-thread CPU seconds (one torch thread), "
                  "what they cost on a core of their own; steady = the median 8-stream "
                  "decode-only step before the prompt arrived, steady after = the same once "
                  "its first token is out (the streams' contexts grew meanwhile); 'at ctx' "
                  "divides each step by the steady step at its streams' context (a line "
                  "through the decode-only steps before and after, by context); decode-only "
                  "floor = that steady step at the context of the slowest 1% of steps, the "
                  "least any step carrying the streams costs (a TPOT SLO under it cannot be "
                  "met by any chunk size); TTFT = the sum of the steps to the first token."
                  + (f" Streams' prompts cut to their last {args.stream_prompt} tokens."
                     if args.stream_prompt else ""))
    if args.chat64:
        crow = []
        for case, runs in chat.items():
            for i, r in enumerate(runs):
                fx = chat["fixed"][i]
                crow.append([case, str(i + 1), f"{r['load']:.1f}", f"{r['tok_s']:.1f}",
                             f"{r['wall_s']:.1f}", f"{r['ttft50_s']:.2f}", f"{r['p99_s']:.1f}",
                             f"{r['tok_s'] / fx['tok_s']:.2f}", f"{r['cpu_tok_s']:.1f}",
                             f"{r['cpu_tok_s'] / fx['cpu_tok_s']:.2f}", str(r["exact"])])
        if not args.no_append:
            text += append_rows(
                f"chat{args.chat64} throughput, prefill budget fixed vs time-sized, "
                f"{args.dtype}, step-time model fed {args.fit_clock} time, all at t=0, "
                f"interleaved",
                ["budget", "round", "load avg", "output tok/s", "wall s", "p50 TTFT s",
                 "p99 latency s", "tok/s vs fixed", "tok per model-CPU s",
                 "CPU tok/s vs fixed", "exact lengths"], crow,
                notes="Same processes per case and interleaving as above; tok per model-CPU s = "
                      "output tokens / model-thread CPU seconds, the throughput on cores of its "
                      "own.")
    print(text)

