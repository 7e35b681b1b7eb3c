"""chat64 through the engine with one part of the defaults off and on in alternate rounds, one
process.

The bundled model at the engine's defaults (on this CPU: int4, bf16, the C kernels); the
workload's 64 requests all at once, greedy, each to its full length, every prompt made new per
run by a first token of its own (no run reads another's cached prefix); before the rounds, one
warm-up pass of the whole workload. Each round runs the workload with the part detached and
attached, in alternating order, so both see the same machine; the table gives each round's wall
time and output rate, and the ratio of the medians. Parts (`--part`):
- `layer_loop`: the model's layer loop (`batcher/models/llama_layer_loop.py`);
- `head_copy`: the int8 LM head's dense copy, used for steps of more than a few rows.

`--decode-rows 1,8,32` measures decode-only steps instead: that many rows (300-token contexts)
through the runner the engine builds, the part off and on step by step in alternating order,
the median of `--steps` steps each.

    python -m scripts.bench layer_loop [--part layer_loop] [--rounds 3] [--no-append]
    python -m scripts.bench layer_loop --part head_copy --decode-rows 1,8,16,32,64
"""

from __future__ import annotations

import asyncio
import statistics
import time

from batcher.bench.common import append_rows, load_workload
from scripts.bench._shared import command, on_model_thread, parser, serving_runner

FIRST_TOKEN = 1000  # plus the run's number: each run's prompts share no cached prefix
DECODE_CTX = 300  # tokens of context of each row in --decode-rows steps
DECODE_BLOCK = 16  # the default block size, which the row tables are laid out in


PARTS = {"layer_loop": "Layer loop", "head_copy": "The LM head's dense copy"}


def _part(model: object, part: str) -> tuple[object, str, object]:
    """(the object that holds the part, its attribute, its value when attached)."""
    if part == "layer_loop":
        holder, attr = model, "layer_loop"
        why = "not bf16 on this CPU, BATCHER_LAYER_LOOP=0, or no C compiler"
    else:
        holder, attr = getattr(model, "lm_head", None), "dense"
        why = "not an int8 head with a dense copy"
    value = getattr(holder, attr, None)
    if value is None:
        raise SystemExit(f"this model runs no {part} here ({why})")
    return holder, attr, value


def _decode_steps(part: str, row_counts: list[int], steps: int) -> list[list[str]]:
    from batcher.core.outputs import ScheduledSeq, SchedulerOutput
    from batcher.core.sampling import SamplingParams
    from batcher.runtime.thread_tuner import TUNED_BELOW_ROWS, group_of

    per_row = -(-(DECODE_CTX + 1) // DECODE_BLOCK)
    runner = serving_runner(max(row_counts) * per_row)
    if runner.block_size != DECODE_BLOCK:
        raise SystemExit(f"the default block size is {runner.block_size}, not {DECODE_BLOCK}")
    holder, attr, attached = _part(runner.model, part)
    greedy = SamplingParams(temperature=0.0)
    table: list[list[str]] = []

    def settle(step: SchedulerOutput, rows: int) -> None:
        # The thread tuner picks a count for small steps from their first few: timed steps
        # come after its choice (made from steps with the part off and on alike), not during.
        tuner, group = runner.tuner, 1 << group_of(rows)
        for i in range(64):
            if tuner is None or rows >= TUNED_BELOW_ROWS or group in tuner.chosen():
                return
            setattr(holder, attr, attached if i % 2 else None)
            runner.execute(step)

    def run() -> None:
        for n in row_counts:
            step = [ScheduledSeq(f"s{i}", [7], DECODE_CTX,
                                 list(range(i * per_row, (i + 1) * per_row)), True, greedy)
                    for i in range(n)]
            settle(SchedulerOutput(step), n)
            times: dict[str, list[float]] = {"off": [], "on": []}
            for r in range(steps + 2):  # the first two of each are warm-up
                cases = (("off", None), ("on", attached))
                for name, value in (cases if r % 2 == 0 else cases[::-1]):
                    setattr(holder, attr, value)
                    started = time.perf_counter()
                    runner.execute(SchedulerOutput(list(step)))
                    if r >= 2:
                        times[name].append(time.perf_counter() - started)
            off, on = (statistics.median(times[k]) for k in ("off", "on"))
            table.append([str(n), f"{off * 1e3:.1f}", f"{on * 1e3:.1f}", f"x{on / off:.2f}"])
            print(f"# {n} rows: off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms", flush=True)

    try:
        on_model_thread(run)
    finally:
        setattr(holder, attr, attached)
    return table


async def _measure(rounds: int, part: str) -> tuple[list[dict[str, float]], int]:
    from batcher.bundled import DEFAULT_MODEL
    from batcher.core.request import Request
    from batcher.core.sampling import SamplingParams
    from batcher.engine.config import EngineConfig
    from batcher.engine.factory import build_engine

    engine = build_engine(DEFAULT_MODEL, EngineConfig())
    await engine.start()
    try:
        holder, attr, attached = _part(engine.runner.model, part)
    except SystemExit:
        await engine.stop()
        raise
    work = load_workload()

    async def one(req: Request) -> int:
        n = 0
        async for ev in engine.generate(req):
            n += len(ev.token_ids)  # an event may carry several tokens
        return n

    runs = 0

    async def run(tag: str, items: list[dict]) -> tuple[float, int]:
        nonlocal runs
        runs += 1
        reqs = [Request(f"{tag}-{i}", [FIRST_TOKEN + runs, *w["prompt_ids"]],
                        SamplingParams(max_tokens=w["max_new_tokens"], temperature=0.0,
                                       ignore_eos=True)) for i, w in enumerate(items)]
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(r) for r in reqs))
        return time.perf_counter() - started, sum(counts)

    rows = []
    try:
        await run("warm", work)
        for r in range(rounds):
            row: dict[str, float] = {}
            cases = (("off", None), ("on", attached))
            for name, value in (cases if r % 2 == 0 else cases[::-1]):
                setattr(holder, attr, value)
                row[name], tokens = await run(f"{name}{r}", work)
            rows.append(row)
            print(f"# round {r + 1}: off {row['off']:.2f} s, on {row['on']:.2f} s", flush=True)
    finally:
        setattr(holder, attr, attached)
        await engine.stop()
    return rows, tokens


def main(argv: list[str]) -> None:
    p = parser(__name__, __doc__.splitlines()[0])
    p.add_argument("--part", choices=sorted(PARTS), default="layer_loop")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-rows", metavar="N,N,...",
                   help="decode-only steps of these row counts instead of chat64")
    p.add_argument("--steps", type=int, default=12, help="timed steps a case, --decode-rows")
    p.add_argument("--no-append", action="store_true", help="print only, no BENCHMARKS.md row")
    a = p.parse_args(argv)
    if a.decode_rows:
        counts = [int(n) for n in a.decode_rows.split(",")]
        if not counts or min(counts) < 1:
            raise SystemExit("--decode-rows takes positive row counts, e.g. 1,8,32")
        steps = _decode_steps(a.part, counts, a.steps)
        header = ["decode rows", "off ms", "on ms", "on / off"]
        notes = (f"Decode-only steps, {DECODE_CTX}-token contexts, through the runner the "
                 "engine builds at its defaults (not started: steps by hand, on a thread of "
                 f"their own); medians of {a.steps} steps a case, off and on alternating step "
                 "by step after two warm-up pairs, and for steps the thread tuner measures, "
                 "after it chose.")
        text = ("" if a.no_append else
                append_rows(f"{PARTS[a.part]} off vs on: decode steps, bundled model, defaults",
                            header, steps, notes, command=command(__name__, *argv)))
        print(text or "\n".join(" | ".join(r) for r in steps))
        return
    rows, tokens = asyncio.run(_measure(a.rounds, a.part))
    table = [[str(i + 1), f"{r['off']:.2f}", f"{r['on']:.2f}", f"{tokens / r['off']:.1f}",
              f"{tokens / r['on']:.1f}", f"x{r['on'] / r['off']:.2f}"]
             for i, r in enumerate(rows)]
    off = statistics.median(r["off"] for r in rows)
    on = statistics.median(r["on"] for r in rows)
    table.append(["median", f"{off:.2f}", f"{on:.2f}", f"{tokens / off:.1f}", f"{tokens / on:.1f}",
                  f"x{on / off:.2f}"])
    header = ["round", "off s", "on s", "off output tok/s", "on output tok/s", "on / off time"]
    notes = (f"{tokens} output tokens a run (64 requests at once, greedy, full length, prompts "
             "new to the prefix cache each run). One engine, one loaded model; the part detached "
             "and attached in alternating order round by round, after a warm-up pass of the "
             "whole workload.")
    text = ("" if a.no_append else
            append_rows(f"{PARTS[a.part]} off vs on: chat64 through the engine, bundled "
                        "model, defaults", header, table, notes,
                        command=command(__name__, *argv)))
    print(text or "\n".join(" | ".join(r) for r in table))
