"""Structured outputs' cost on the bundled model: half the rows constrained to a schema vs none.

The same batch of requests at default settings with no row constrained and with half the rows
constrained to a JSON schema, interleaved in one run (none, half, none, half, ...). Prints a table
of output tok/s (all rows) and of the free rows' time per output token, and appends it to
BENCHMARKS.md.

    python -m scripts.bench structured [--rows 16] [--tokens 48] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from batcher.bench.common import append_rows
from batcher.core.sampling import SamplingParams
from batcher.llm import AsyncLLM
from batcher.structured.grammars import json_schema_grammar
from scripts.bench._shared import parser

# A schema no answer can close early (a long required string), so constrained rows decode as
# many tokens as free ones and the batch keeps its size: the comparison is per step, not per
# answer length.
SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
          "required": ["story"], "additionalProperties": False}
PROMPT = "Write a long story about a lighthouse keeper, as JSON with a 'story' field."


async def one_round(llm: AsyncLLM, rows: int, tokens: int, constrained: int
                    ) -> tuple[float, float, float]:
    """(output tok/s over all rows, median seconds per output token of the free rows, output
    tokens per CPU second of the whole process: the grammar helper thread included)."""
    grammar = json_schema_grammar(SCHEMA, "schema")

    async def run(i: int) -> tuple[int, float, bool]:
        sp = SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=i >= constrained,
                            grammar=grammar if i < constrained else None)
        t0 = time.perf_counter()
        out = await llm.generate(PROMPT, sp)
        return len(out.token_ids), (time.perf_counter() - t0) / max(1, len(out.token_ids)), \
            i < constrained

    t0, cpu0 = time.perf_counter(), time.process_time()
    results = await asyncio.gather(*(run(i) for i in range(rows)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    total = sum(n for n, _, _ in results)
    free = [s for _, s, c in results if not c]
    return total / wall, statistics.median(free), total / cpu


def main(argv: list[str]) -> None:
    ap = parser(__name__, __doc__, first_paragraph=True)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    asyncio.run(run(ap.parse_args(argv)))


async def run(args: argparse.Namespace) -> None:
    async with await AsyncLLM.load() as llm:
        await one_round(llm, 2, 4, 1)  # warm-up: the grammar tokenizer is built once
        table = []
        for r in range(1, args.rounds + 1):
            for label, constrained in (("none", 0), ("half", args.rows // 2)):
                load = os.getloadavg()[0]
                tps, free_s, per_cpu = await one_round(llm, args.rows, args.tokens, constrained)
                table.append([label, str(r), f"{load:.1f}", f"{tps:.1f}", f"{free_s * 1e3:.1f}",
                              f"{per_cpu:.1f}"])
                print(table[-1], flush=True)
    base = {row[1]: (float(row[3]), float(row[5])) for row in table if row[0] == "none"}
    for row in table:
        row += [f"{float(row[3]) / base[row[1]][0]:.2f}", f"{float(row[5]) / base[row[1]][1]:.2f}"]
    text = append_rows(
        "Structured outputs: half the rows constrained vs none",
        ["constrained rows", "round", "load avg", "output tok/s", "free rows ms/token",
         "tok per CPU s", "tok/s vs none", "tok per CPU s vs none"], table,
        notes=f"{args.rows} requests at once, {args.tokens} output tokens each, bundled model "
              "at default settings, temperature 1; constrained rows follow a JSON schema with a "
              "2000-character string (they cannot end early). tok per CPU s = output tokens / "
              "CPU seconds of the whole process (model thread and grammar helper), the cost on "
              "cores of its own. Shared machine: compare rows of one round, not absolute "
              "numbers.")
    print(text)

