"""Prompt logprobs' cost on the bundled model: streams beside a long prompt scored or not.

Decoding streams beside one long prompt scored with `prompt_logprobs` (echo + logprobs) and
beside the same prompt without, interleaved in one run (plain, scored, plain, scored, ...). Prints
the streams' median time per output token, the long prompt's time to its first token, and output
tokens per process-CPU second; then, with nothing else in the process, the CPU time of one mixed
step (decode rows and a prefill chunk) with the chunk scored and not. Appends both tables to
BENCHMARKS.md.

    python -m scripts.bench prompt_logprobs [--streams 8] [--tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from batcher.bench.common import append_rows
from batcher.core.outputs import ScheduledSeq, SchedulerOutput
from batcher.core.sampling import SamplingParams
from batcher.llm import AsyncLLM
from scripts.bench._shared import parser

TEXT = ("The lighthouse keeper climbed the stairs each evening to light the lamp, counting the "
        "steps and listening to the sea below. ") * 20


async def one_round(llm: AsyncLLM, streams: int, tokens: int, scored: bool, tag: str
                    ) -> tuple[float, float, float]:
    """(streams' median seconds per output token, the long prompt's seconds to its first
    token, output tokens per CPU second of the whole process)."""
    async def stream(i: int) -> tuple[int, float]:
        sp = SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True)
        t0 = time.perf_counter()
        out = await llm.generate(f"Story {i}: once", sp)
        return len(out.token_ids), (time.perf_counter() - t0) / len(out.token_ids)

    async def long_prompt() -> float:
        await asyncio.sleep(0.5)  # the streams are decoding when it arrives
        # NOTE: a new leading word each round, so no round reuses another's cached prefix.
        sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5 if scored else None)
        t0 = time.perf_counter()
        await llm.generate(f"{tag}. {TEXT}", sp)
        return time.perf_counter() - t0

    cpu0 = time.process_time()
    *results, ttft = await asyncio.gather(*(stream(i) for i in range(streams)), long_prompt())
    cpu = time.process_time() - cpu0
    return (statistics.median(s for _, s in results), ttft,
            sum(n for n, _ in results) / cpu)


def step_cpu(decodes: int, chunk: int, reps: int) -> list[list[str]]:
    """CPU ms of one step of `decodes` decode rows and a `chunk`-token prefill chunk, with the
    chunk's rows scored (5 alternatives) and not, interleaved `reps` times."""
    from batcher.engine.config import DEFAULT_MODEL
    from batcher.models.loader import load_model
    from batcher.runtime.model_runner import ModelRunner

    loaded = load_model(DEFAULT_MODEL)
    runner = ModelRunner(loaded, num_blocks=256, block_size=16)
    greedy = SamplingParams(temperature=0)
    ids = [100 + i % 5000 for i in range(chunk + 1)]

    def step(scored: bool) -> float:
        seqs = [ScheduledSeq(f"d{i}", [7], 64 + i, list(range(8 * i, 8 * i + 8)), True, greedy)
                for i in range(decodes)]
        blocks = list(range(100, 100 + -(-chunk // 16)))
        sp = SamplingParams(temperature=0, prompt_logprobs=5 if scored else None)
        seqs.append(ScheduledSeq("p", ids[:chunk], 0, blocks, False, sp,
                                 score_targets=tuple(ids[1:chunk + 1]) if scored else ()))
        t0 = time.process_time()
        runner.execute(SchedulerOutput(seqs))
        return time.process_time() - t0

    step(True), step(False)  # warm-up
    rows = []
    for r in range(1, reps + 1):
        plain, scored = step(False), step(True)
        rows.append([str(r), f"{os.getloadavg()[0]:.1f}", f"{plain * 1e3:.0f}",
                     f"{scored * 1e3:.0f}", f"{scored / plain:.2f}"])
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str]) -> None:
    ap = parser(__name__, __doc__, first_paragraph=True)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=256)
    asyncio.run(run(ap.parse_args(argv)))


async def run(args: argparse.Namespace) -> None:
    async with await AsyncLLM.load() as llm:
        prompt_tokens = len(llm.encode(f"round. {TEXT}"))
        await one_round(llm, 2, 4, True, "warm-up")
        table = []
        for r in range(1, args.rounds + 1):
            for label, scored in (("plain", False), ("scored", True)):
                load = os.getloadavg()[0]
                tpot, ttft, per_cpu = await one_round(llm, args.streams, args.tokens, scored,
                                                      f"Round {r} {label}")
                table.append([label, str(r), f"{load:.1f}", f"{tpot * 1e3:.0f}",
                              f"{ttft * 1e3:.0f}", f"{per_cpu:.1f}"])
                print(table[-1], flush=True)
    base = {row[1]: row for row in table if row[0] == "plain"}
    for row in table:
        b = base[row[1]]
        row += [f"{float(row[3]) / float(b[3]):.2f}", f"{float(row[4]) / float(b[4]):.2f}"]
    text = append_rows(
        "Prompt logprobs: a long prompt scored beside decoding streams vs the same unscored",
        ["long prompt", "round", "load avg", "streams ms/token", "long prompt TTFT ms",
         "stream tok per CPU s", "ms/token vs plain", "TTFT vs plain"], table,
        notes=f"{args.streams} streams of {args.tokens} output tokens, and one {prompt_tokens}-"
              "token prompt (max_tokens 1) arriving 0.5 s later, scored with 5 alternatives per "
              "position or not; bundled model at default settings, chunked prefill. Shared "
              "machine: compare rows of one round, not absolute numbers.")
    print(text)
    rows = step_cpu(args.streams, args.chunk, 5)
    print(append_rows(
        "Prompt logprobs: CPU time of a mixed step with its prefill chunk scored or not",
        ["rep", "load avg", "plain step CPU ms", "scored step CPU ms", "scored vs plain"], rows,
        notes=f"One step of {args.streams} decode rows and a {args.chunk}-token prefill chunk, "
              "bundled model at default settings, the runner alone in the process; scoring adds "
              "the chunk's rows to the lm_head and a log_softmax and top-5 over each. Process "
              "CPU time, interleaved: comparable within a row on a shared machine."))

