"""Host time to fill a replayed step's inputs, against the eager step's own preparation.

A captured step (`batcher/runtime/cuda_graphs.py`, `batcher/runtime/mixed_graphs.py`) replays
in a few launches, but first the host writes every row's token, position, slot, length and
block table into the graph's buffers; with a GPU step of about a millisecond, that host time is
the step's floor. Measured here on the CPU (the host's work is the same there; the graph is
stubbed, the buffers are CPU tensors), side by side in alternating rounds:
- a decode-only step's fill (`DecodeGraphs.run`) and a step with a 64-token prompt chunk
  (the bucket's choice and `MixedStepInputs.fill`);
- the same decode fill written row by row (a small tensor and a slice per row: how it was
  written before `batcher/runtime/step_rows.py`), kept here as the baseline;
- `ModelRunner.prepare` on the same steps: what the eager path builds.

    python -m scripts.bench graph_inputs [--rows 1,32,256] [--ctx 512] [--no-append]
"""

from __future__ import annotations

import statistics
import time

import torch

from batcher.bench.common import append_rows
from scripts.bench._shared import command, parser

BLOCK = 16
CHUNK = 64


def row_by_row(graphs, sched) -> None:
    """`DecodeGraphs.run` with its fill as a loop over rows (the baseline)."""
    from batcher.runtime.cuda_graphs import pick_size

    seqs = sched.seqs
    n = len(seqs)
    b = pick_size(n, graphs.sizes)
    host, tables = graphs._host, graphs._host_tables
    host[:, :b] = 0
    host[2, :b] = graphs.scratch_slot
    host[3, :b] = 1
    tables[:b] = 0
    bs = graphs.block_size
    for i, s in enumerate(seqs):
        pos = s.start_pos
        host[0, i] = s.token_ids[0]
        host[1, i] = pos
        host[2, i] = s.block_ids[pos // bs] * bs + pos % bs
        host[3, i] = pos + 1
        used = s.block_ids[: pos // bs + 1]
        tables[i, : len(used)] = torch.tensor(used, dtype=torch.int32)
    graphs.ids[:b].copy_(host[0, :b], non_blocking=True)
    graphs.positions[:b].copy_(host[1, :b], non_blocking=True)
    graphs.slots[:b].copy_(host[2, :b], non_blocking=True)
    graphs.lens[:b].copy_(host[3, :b], non_blocking=True)
    graphs.tables[:b].copy_(tables[:b], non_blocking=True)
    graphs.graphs[b].replay()


def timed(run, reps: int) -> float:
    """Median of `reps` runs of `run()`, in ms."""
    run()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main(argv: list[str]) -> int:
    ap = parser(__name__, __doc__, raw=True)
    ap.add_argument("--rows", default="1,32,256", help="decode rows per step")
    ap.add_argument("--ctx", type=int, default=512, help="tokens cached per decode row")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-append", action="store_true", help="do not append to BENCHMARKS.md")
    args = ap.parse_args(argv)

    from batcher.core.outputs import ScheduledSeq, SchedulerOutput
    from batcher.core.sampling import SamplingParams
    from batcher.models.loader import load_model
    from batcher.runtime.cuda_graphs import DecodeGraphs, graph_sizes
    from batcher.runtime.mixed_graphs import MixedStepInputs, pick_bucket, token_buckets
    from batcher.runtime.model_runner import ModelRunner

    class Stubbed(DecodeGraphs):  # the buffers alone: replays do nothing
        def _capture(self, device: torch.device) -> None:
            for b in self.sizes:
                self.graphs[b] = type("Replay", (), {"replay": lambda _: None})()
                self.outputs[b] = torch.zeros(b, 1)

    counts = [int(r) for r in args.rows.split(",")]
    top = max(counts) + 1
    per_row = -(-(args.ctx + 1) // BLOCK)
    max_blocks = per_row + 1
    blocks = top * per_row + CHUNK // BLOCK + 1
    cpu = torch.device("cpu")
    graphs = Stubbed(None, None, BLOCK, blocks, max_blocks, graph_sizes(top), cpu)
    buckets = [MixedStepInputs(t, top, max_blocks, BLOCK, blocks * BLOCK, cpu)
               for t in token_buckets(8192)]
    # The eager path's preparation (tiny model: `prepare` reads only the step).
    runner = ModelRunner(load_model("tiny", dtype="float32", device="cpu"), blocks + 1, BLOCK)
    sp = SamplingParams(temperature=0.0)
    rows = []
    for n in counts:
        decodes = [ScheduledSeq(str(i), [7], args.ctx, list(range(i * per_row, (i + 1) * per_row)),
                                True, sp) for i in range(n)]
        first = n * per_row
        prompt = ScheduledSeq("p", [7] * CHUNK, 0, list(range(first, first + CHUNK // BLOCK)),
                              True, sp)
        decode, mixed = SchedulerOutput(decodes), SchedulerOutput([*decodes, prompt])
        cases = [("decode fill", lambda: graphs.run(decode)),
                 ("decode fill, row by row (baseline)", lambda: row_by_row(graphs, decode)),
                 ("decode step, eager prepare", lambda: runner.prepare(decode)),
                 (f"+{CHUNK}-token chunk: bucket fill",
                  lambda: buckets[pick_bucket(buckets, mixed)].fill(mixed)),
                 (f"+{CHUNK}-token chunk: eager prepare", lambda: runner.prepare(mixed))]
        got: dict[str, list[float]] = {name: [] for name, _ in cases}
        for r in range(3):  # alternating rounds, each order reversed in turn
            for name, run in (cases if r % 2 == 0 else cases[::-1]):
                got[name].append(timed(run, args.reps))
        ms = {name: statistics.median(v) for name, v in got.items()}
        base = ms["decode fill, row by row (baseline)"]
        for name, _ in cases:
            ratio = "-" if "row by row" in name else (
                f"x{base / ms[name]:.1f} vs row by row" if name.startswith("decode fill") else
                f"x{ms[name.replace('bucket fill', 'eager prepare')] / ms[name]:.1f} vs "
                "eager" if "bucket" in name else "-")
            rows.append([str(n), name, f"{ms[name]:.3f} ms", ratio])
    for r in rows:
        print(" | ".join(r))
    if not args.no_append:
        print(append_rows(
            f"Host time to fill a replayed step's inputs (decode rows with {args.ctx} tokens "
            "cached each)", ["decode rows", "what", "median", "ratio"], rows,
            notes="CPU tensors, graphs stubbed: the host's share of a replayed GPU step. "
            "Medians of alternating rounds.", command=command(__name__, *argv)))
    return 0
