"""chat64 through the engine with the layer loop off and on in alternate rounds, one process.

The bundled model at the engine's defaults (on this CPU: int4, bf16, the C kernels); the
workload's 64 requests all at once, greedy, each to its full length, every prompt made new per
run by a first token of its own (no run reads another's cached prefix); before the rounds, one
warm-up pass of the whole workload. Each round runs the workload with the model's layer loop
(`batcher/models/llama_layer_loop.py`) detached and attached, in alternating order, so both see
the same machine; the table gives each round's wall time and output rate, and the ratio of the
medians.

    python -m scripts.bench layer_loop [--rounds 3] [--no-append]
"""

from __future__ import annotations

import asyncio
import statistics
import time

from batcher.bench.common import append_rows, load_workload
from scripts.bench._shared import command, parser

FIRST_TOKEN = 1000  # plus the run's number: each run's prompts share no cached prefix


async def _measure(rounds: int) -> tuple[list[dict[str, float]], int]:
    from batcher.bundled import DEFAULT_MODEL
    from batcher.core.request import Request
    from batcher.core.sampling import SamplingParams
    from batcher.engine.config import EngineConfig
    from batcher.engine.factory import build_engine

    engine = build_engine(DEFAULT_MODEL, EngineConfig())
    await engine.start()
    model = engine.runner.model
    loop = model.layer_loop
    if loop is None:
        await engine.stop()
        raise SystemExit("this model runs no layer loop here (not bf16 on this CPU, "
                         "BATCHER_LAYER_LOOP=0, or no C compiler)")
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
            cases = (("off", None), ("on", loop))
            for name, attached in (cases if r % 2 == 0 else cases[::-1]):
                model.layer_loop = attached
                row[name], tokens = await run(f"{name}{r}", work)
            rows.append(row)
            print(f"# round {r + 1}: off {row['off']:.2f} s, on {row['on']:.2f} s", flush=True)
    finally:
        model.layer_loop = loop
        await engine.stop()
    return rows, tokens


def main(argv: list[str]) -> None:
    p = parser(__name__, __doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-append", action="store_true", help="print only, no BENCHMARKS.md row")
    a = p.parse_args(argv)
    rows, tokens = asyncio.run(_measure(a.rounds))
    table = [[str(i + 1), f"{r['off']:.2f}", f"{r['on']:.2f}", f"{tokens / r['off']:.1f}",
              f"{tokens / r['on']:.1f}", f"x{r['on'] / r['off']:.2f}"]
             for i, r in enumerate(rows)]
    off = statistics.median(r["off"] for r in rows)
    on = statistics.median(r["on"] for r in rows)
    table.append(["median", f"{off:.2f}", f"{on:.2f}", f"{tokens / off:.1f}", f"{tokens / on:.1f}",
                  f"x{on / off:.2f}"])
    header = ["round", "loop off s", "loop on s", "off output tok/s", "on output tok/s",
              "on / off time"]
    notes = (f"{tokens} output tokens a run (64 requests at once, greedy, full length, prompts "
             "new to the prefix cache each run). One engine, one loaded model; the loop detached "
             "and attached in alternating order round by round, after a warm-up pass of the "
             "whole workload.")
    text = ("" if a.no_append else
            append_rows("Layer loop off vs on: chat64 through the engine, bundled model, "
                        "defaults", header, table, notes, command=command(__name__, *argv)))
    print(text or "\n".join(" | ".join(r) for r in table))
