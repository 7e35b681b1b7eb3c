"""What a prompt token costs read in small chunks beside running streams, against the whole
budget: the floor under chunked prefill's two goals together.

On the bundled model as `batcher serve` loads it by default (the runner `build_engine` makes
from the default `EngineConfig`: int4 on a CPU with native bf16, no dense copy of the layers,
the C kernels, the default KV pool, so a prompt read in chunks keeps its staged K/V, and the
thread tuner), its steps on a thread of their own as the engine runs them: 8 decode rows (a
300-token context)
alone, and with a chunk of c tokens of a prompt whose first 1,000 tokens are already read, for
c in 4, 8, 16, 32, 64 and the whole budget (320 tokens a step, less the decode rows). Each chunk
case reads a fresh prompt chunk after chunk; its steps alternate with decode-only steps.

A chunk token's cost beside the streams is m(c) = (T(8 + c) - T(8)) / c; the whole budget's is
a = m(whole). Held to a gap of g times the streams' step, a prompt read beside them gets at most
(g - 1) of each step, so its first token comes at least (m / a) x g / (g - 1) times later than
at the whole budget: for the goals of 1.5x the gap and 3x the first token, 3 m / a <= 3, that
is m <= a, and it needs a chunk small enough that its step stays within 1.5x: a machine whose
small steps cost more per row, or whose smallest chunk already lengthens the streams' step by half,
cannot meet both.

    python -m scripts.bench chunk_cost [--rounds 3] [--steps 8] [--no-append]
"""

from __future__ import annotations

import statistics
import time

from batcher.bench.common import append_rows
from scripts.bench._shared import command, on_model_thread, parser, serving_runner

STREAMS, STREAM_CTX, READ = 8, 300, 1000
CHUNKS = (4, 8, 16, 32, 64)
GAP_GOAL = 1.5
BLOCK = 16


def _measure(steps: int, rounds: int) -> dict[str, list[float]]:
    from batcher.core.config import CPU_MAX_NUM_BATCHED_TOKENS
    from batcher.core.outputs import ScheduledSeq, SchedulerOutput
    from batcher.core.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    whole = CPU_MAX_NUM_BATCHED_TOKENS - STREAMS
    stream_blocks = -(-(STREAM_CTX + 1) // BLOCK)
    prompt_blocks = -(-(READ + steps * whole + 1) // BLOCK)
    runner = serving_runner(STREAMS * stream_blocks + prompt_blocks)
    if runner.block_size != BLOCK:
        raise SystemExit(f"the default block size is {runner.block_size}, not {BLOCK}")
    tables = [list(range(i * stream_blocks, (i + 1) * stream_blocks)) for i in range(STREAMS)]
    prompt_table = list(range(STREAMS * stream_blocks, STREAMS * stream_blocks + prompt_blocks))
    decodes = [ScheduledSeq(f"s{i}", [7], STREAM_CTX, tables[i], True, greedy)
               for i in range(STREAMS)]
    times: dict[str, list[float]] = {}

    def timed(seqs: list[ScheduledSeq]) -> float:
        started = time.perf_counter()
        runner.execute(SchedulerOutput(list(seqs)))
        return time.perf_counter() - started

    def run() -> None:
        cases = [(str(c), c) for c in CHUNKS] + [("whole", whole)]
        for r in range(rounds):
            for name, c in cases:
                rid = f"p{r}-{name}"  # a fresh prompt, its first READ tokens read alone
                for start in range(0, READ, 500):
                    runner.execute(SchedulerOutput([ScheduledSeq(
                        rid, [11] * 500, start, prompt_table, False, greedy)]))
                timed(decodes)
                for i in range(steps):
                    chunk = ScheduledSeq(rid, [11] * c, READ + i * c, prompt_table, False, greedy)
                    times.setdefault(name, []).append(timed([*decodes, chunk]))
                    times.setdefault("decode", []).append(timed(decodes))

    on_model_thread(run)
    return times


def main(argv: list[str]) -> None:
    p = parser(__name__, __doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="timed steps per case and round")
    p.add_argument("--no-append", action="store_true", help="print only, no BENCHMARKS.md row")
    a = p.parse_args(argv)
    times = _measure(a.steps, a.rounds)
    decode = statistics.median(times["decode"])
    from batcher.core.config import CPU_MAX_NUM_BATCHED_TOKENS

    sizes = {**{str(c): c for c in CHUNKS}, "whole": CPU_MAX_NUM_BATCHED_TOKENS - STREAMS}
    per_token = {name: (statistics.median(times[name]) - decode) / n
                 for name, n in sizes.items()}
    whole = per_token["whole"]
    rows = []
    for name, n in sizes.items():
        step = statistics.median(times[name])
        ratio = per_token[name] / whole
        rows.append([f"{n}" + (" (the whole budget)" if name == "whole" else ""),
                     f"{step * 1e3:.1f}", f"x{step / decode:.2f}",
                     f"{per_token[name] * 1e3:.2f}", f"x{ratio:.2f}",
                     f"x{3 * ratio:.1f}" if step <= GAP_GOAL * decode else "none"])
    header = ["prompt tokens in the step", "step ms (8 decode rows + chunk)",
              "step / decode-only", "ms per prompt token (m)", "m / whole budget's",
              "first-token floor at a 1.5x gap (3 m / a)"]
    notes = (f"Decode-only step (8 rows, {STREAM_CTX}-token context): {decode * 1e3:.1f} ms. "
             f"Medians of {a.steps} steps x {a.rounds} rounds per case; each chunk continues a "
             f"prompt whose first {READ} tokens were read; decode-only steps alternate with "
             "the chunk steps. The last column is the least time to first token, against the "
             "whole budget's, of any pacing that reads the prompt in chunks of that size and "
             "keeps the streams' steps within 1.5x of their own (chunked prefill's goals: at "
             "most 1.5x and 3x); none where a step with such a chunk is itself over 1.5x.")
    text = ("" if a.no_append else
            append_rows("Chunk cost: a prompt token read in small chunks beside 8 streams vs the "
                        "whole budget, bundled model as `batcher serve` loads it", header, rows,
                        notes,
                        command=command(__name__, *argv)))
    print(text or "\n".join(" | ".join(r) for r in rows))
