"""One stream, the bundled model, with and without n-gram speculative decoding, side by side.

Two chat workloads: a repetitive one (the model rewrites a given function with one change, so
most of its answer is in its prompt) and a non-repetitive one (free prose). Each request runs
alone through the real engine (its model thread, the scheduler, the sampler), greedy, a fixed
number of tokens; engines with speculation off and on share one loaded model and alternate
request by request, so both see the same machine load. Reported per workload and mode: output
tokens per second of wall time, CPU milliseconds per output token (the whole process: robust to
a shared machine), drafted and accepted tokens, and how many of the on-mode's tokens equal the
off-mode's (bf16 may flip a near-tie: a drafted position's logits come from a multi-token row).

Usage: python -m scripts.bench speculative [--rounds 3] [--max-tokens 128] [--dtype bfloat16]
       [--quantization none] [--k 4] [--no-append]
       python -m scripts.bench speculative --numerics   (one drafted row vs one-token steps:
       how far their logits differ in fp32 and bf16, and each from fp32)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from batcher.bench.common import append_rows
from batcher.core.config import SchedulerConfig
from batcher.core.request import Request
from batcher.core.sampling import SamplingParams
from batcher.engine.engine import AsyncEngine
from scripts.bench._shared import parser

CODE = '''def summarize(orders, tax_rate):
    """Total, average and largest order after tax."""
    total = 0.0
    largest = None
    for order in orders:
        amount = order["price"] * order["quantity"]
        amount = amount * (1 + tax_rate)
        total += amount
        if largest is None or amount > largest:
            largest = amount
    average = total / len(orders) if orders else 0.0
    return {"total": total, "average": average, "largest": largest}
'''

WORKLOADS = {
    "repetitive": "Here is a Python function:\n\n" + CODE + "\nRewrite the whole function with one "
                  "change: rename the variable `total` to `grand_total`. Output only the code.",
    "non-repetitive": "Write a short story about a lighthouse keeper who finds a message in a "
                      "bottle. Use vivid, varied language.",
}
MODES = ("none", "ngram")


async def one(engine: AsyncEngine, rid: str, prompt: list[int], max_tokens: int
              ) -> tuple[list[int], float, float]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens: list[int] = []
    wall, cpu = time.perf_counter(), time.process_time()
    async for ev in engine.generate(Request(rid, prompt, sp)):
        tokens += ev.token_ids
    return tokens, time.perf_counter() - wall, time.process_time() - cpu


async def run(a: argparse.Namespace) -> None:
    from batcher.models.loader import load_model
    from batcher.runtime.model_runner import ModelRunner
    from batcher.tokenizer.tokenizer import load_tokenizer

    loaded = await asyncio.to_thread(load_model, "smollm2-135m", dtype=a.dtype, device="cpu",
                                     quantization=a.quantization)
    tok = load_tokenizer()
    engines = {}
    for mode in MODES:
        cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=320, speculative=mode,
                              num_speculative_tokens=a.k)
        engines[mode] = AsyncEngine(ModelRunner(loaded, num_blocks=256, block_size=16), tok, cfg)
    prompts = {w: tok.apply_chat_template([{"role": "user", "content": text}])
               for w, text in WORKLOADS.items()}
    for mode in MODES:  # warm-up: first steps pay one-off costs
        await one(engines[mode], f"warm-{mode}", prompts["non-repetitive"], 8)
    res: dict[tuple[str, str], dict[str, list]] = {
        (w, m): {"tps": [], "cpu": [], "tokens": []} for w in WORKLOADS for m in MODES}
    drafted = {(w, m): [0, 0] for w in WORKLOADS for m in MODES}
    for r in range(a.rounds):
        for w, prompt in prompts.items():
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                st = engines[mode].scheduler.stats
                before = (st.spec_draft_tokens, st.spec_accepted_tokens)
                toks, wall, cpu = await one(engines[mode], f"{w}-{mode}-{r}", prompt,
                                            a.max_tokens)
                drafted[w, mode][0] += st.spec_draft_tokens - before[0]
                drafted[w, mode][1] += st.spec_accepted_tokens - before[1]
                cell = res[w, mode]
                cell["tps"].append(len(toks) / wall)
                cell["cpu"].append(1000 * cpu / len(toks))
                cell["tokens"] = toks
                print(f"# round {r} {w:15s} {mode:6s} {len(toks) / wall:6.1f} tok/s "
                      f"{1000 * cpu / len(toks):6.1f} CPU ms/token", flush=True)
    for e in engines.values():
        await e.stop()

    header = ["workload", "speculative", "tok/s (median)", "x of none", "CPU ms/token",
              "x of none", "drafted / accepted", "tokens equal to none"]
    rows = []
    for w in WORKLOADS:
        base = res[w, "none"]
        for m in MODES:
            c = res[w, m]
            tps, cpu = statistics.median(c["tps"]), statistics.median(c["cpu"])
            same = sum(1 for _ in _common_prefix(c["tokens"], base["tokens"]))
            d, acc = drafted[w, m]
            rows.append([w, m, f"{tps:.1f}", f"x{tps / statistics.median(base['tps']):.2f}",
                         f"{cpu:.1f}", f"x{cpu / statistics.median(base['cpu']):.2f}",
                         f"{d} / {acc}" if m != "none" else "-",
                         f"{same}/{len(c['tokens'])}"])
    for row in rows:
        print(" | ".join(row))
    load = os.getloadavg()
    notes = (f"One stream, greedy, {a.max_tokens} tokens per request, {a.rounds} rounds, modes "
             f"alternating request by request on one loaded model ({a.dtype}, quantization "
             f"{a.quantization}, k={a.k}). Shared machine: load average {load[0]:.1f} / "
             f"{load[1]:.1f} at the end of the run; compare the ratios, not the absolute "
             f"numbers. 'tokens equal to none': the common prefix of the last round's outputs.")
    if not a.no_append:
        append_rows("Speculative decoding by n-gram lookup, one stream (scripts/bench/"
                    "speculative.py)", header, rows, notes)


def numerics() -> None:
    """The logits of the next 6 positions of a prompt, computed as one 6-token row (a drafted
    row) and as 6 one-token steps (plain decoding), in fp32 and bf16."""
    import torch

    from batcher.core.outputs import ScheduledSeq, SchedulerOutput
    from batcher.models.loader import load_model
    from batcher.runtime.model_runner import ModelRunner
    from batcher.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer()
    greedy = SamplingParams(temperature=0.0)
    prompt = tok.encode(CODE + "\n" + CODE[:60])
    nxt = tok.encode(CODE[60:120], add_special_tokens=False)[:5]
    table = list(range(-(-(len(prompt) + len(nxt)) // 16)))

    def logits(runner: ModelRunner, seq: ScheduledSeq) -> torch.Tensor:
        ids, pos, meta, idx, _ = runner.prepare(SchedulerOutput([seq]))
        return runner.model(ids, pos, meta, runner.kv_caches, idx).float()

    out: dict[tuple[str, str], torch.Tensor] = {}
    for dtype in ("float32", "bfloat16"):
        lm = load_model("smollm2-135m", dtype=dtype, device="cpu")
        for mode in ("one-token steps", "one drafted row"):
            runner = ModelRunner(lm, num_blocks=len(table), block_size=16)
            logits(runner, ScheduledSeq("s", prompt[:-1], 0, table, False, greedy))
            row = [prompt[-1], *nxt]
            n = len(prompt) - 1
            if mode == "one-token steps":
                out[dtype, mode] = torch.cat([
                    logits(runner, ScheduledSeq("s", [t], n + i, table, True, greedy))
                    for i, t in enumerate(row)])
            else:
                out[dtype, mode] = logits(runner, ScheduledSeq(
                    "s", row, n, table, True, greedy, draft_token_ids=tuple(nxt)))
    ref = out["float32", "one-token steps"]
    for dtype in ("float32", "bfloat16"):
        a, b = out[dtype, "one-token steps"], out[dtype, "one drafted row"]
        same = (a.argmax(-1) == b.argmax(-1)).all().item()
        print(f"{dtype}: max |steps - row| {(a - b).abs().max().item():.2g}, argmax equal "
              f"{same}; max error vs fp32 steps: steps {(a - ref).abs().max().item():.2g}, "
              f"row {(b - ref).abs().max().item():.2g}")


def _common_prefix(a: list[int], b: list[int]):
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


def main(argv: list[str]) -> None:
    p = parser(__name__, __doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--quantization", default="none", choices=("none", "int8", "int4"))
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    p.add_argument("--no-append", action="store_true", help="print only; leave BENCHMARKS.md")
    p.add_argument("--numerics", action="store_true",
                   help="compare a drafted row's logits with one-token steps' (fp32, bf16)")
    a = p.parse_args(argv)
    if a.numerics:
        numerics()
    else:
        asyncio.run(run(a))

