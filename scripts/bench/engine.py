"""chat64 through the engine vs `transformers` static batching, same weights and dtype, one run.

    python -m scripts.bench engine [--quick] [--dtype bfloat16] [--hf-batches 8,16,32]
"""

from __future__ import annotations

import asyncio
import gc
import time

import torch

from batcher.bench.common import append_rows, load_workload, pct
from batcher.core.config import CacheConfig, SchedulerConfig
from batcher.core.request import Request
from batcher.core.sampling import SamplingParams
from batcher.engine.engine import AsyncEngine
from batcher.models.loader import load_model
from batcher.tokenizer.tokenizer import load_tokenizer
from scripts.bench._shared import left_padded, parser


async def run_engine(loaded, tok, work, args) -> dict:
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            prefill_budget=args.prefill_budget)
    engine = AsyncEngine.from_loaded(loaded, tok, sched, CacheConfig(num_blocks=args.num_blocks))
    peak = 0

    def track(_s, _t):
        nonlocal peak
        peak = max(peak, engine.kv.num_total_blocks - engine.kv.num_free_blocks)

    engine.step_listeners.append(track)
    await engine.start()
    # Warm-up: one short request, so start-up costs are not billed to the run.
    async for _ in engine.generate(Request("warm", [1, 2, 3, 4], SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True))):
        pass
    lat, ttft, counts = [], [], []
    t0 = time.perf_counter()

    async def one(r):
        sp = SamplingParams(max_tokens=r["max_new_tokens"], temperature=0.0, ignore_eos=True)
        n = 0
        async for ev in engine.generate(Request(r["id"], r["prompt_ids"], sp)):
            n += len(ev.token_ids)
            if ev.finished:
                lat.append(time.perf_counter() - t0)
                ttft.append(ev.ttft)
        counts.append(n == r["max_new_tokens"])

    await asyncio.gather(*(one(r) for r in work))
    wall = time.perf_counter() - t0
    stats = engine.scheduler.stats
    total = engine.kv.num_total_blocks
    await engine.stop()
    out_tokens = sum(r["max_new_tokens"] for r in work)
    return {"wall": wall, "tok_s": out_tokens / wall, "p50": pct(lat, 50), "p99": pct(lat, 99),
            "ttft50": pct(ttft, 50), "peak": f"{peak}/{total}", "preempt": stats.preemptions,
            "exact": all(counts)}


def run_hf_static(loaded, work, batch: int) -> dict:
    """Left-padded static batches in arrival order; each runs to its longest member."""
    from tests.hf_reference import hf_model_from_gguf

    model = hf_model_from_gguf(loaded)
    lat = []
    t0 = time.perf_counter()
    for i in range(0, len(work), batch):
        group = work[i:i + batch]
        ids, mask, new = left_padded(group)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)
        lat += [time.perf_counter() - t0] * len(group)
    wall = time.perf_counter() - t0
    del model
    gc.collect()
    out_tokens = sum(r["max_new_tokens"] for r in work)
    return {"wall": wall, "tok_s": out_tokens / wall, "p50": pct(lat, 50), "p99": pct(lat, 99)}


def main(argv: list[str]) -> None:
    ap = parser(__name__, __doc__, raw=True)
    ap.add_argument("--workload", default=None)
    ap.add_argument("--quick", action="store_true", help="first 16 requests")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hf-batches", default="8,16,32", help="'' to skip the baseline")
    ap.add_argument("--max-num-seqs", type=int, default=SchedulerConfig().max_num_seqs)
    ap.add_argument("--max-num-batched-tokens", type=int,
                    default=SchedulerConfig().max_num_batched_tokens)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--prefill-budget", default="time", choices=["time", "fixed"],
                    help="as `batcher serve --prefill-budget` (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for both systems (default: all cores)")
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    work = load_workload(args.workload, 16 if args.quick else None)
    loaded = load_model("smollm2-135m", dtype=args.dtype, device="cpu")
    tok = load_tokenizer(loaded.tokenizer_source)
    ours = asyncio.run(run_engine(loaded, tok, work, args))
    print(f"engine: {ours}", flush=True)
    hf = {}
    for b in [int(x) for x in args.hf_batches.split(",") if x]:
        hf[b] = run_hf_static(loaded, work, b)
        print(f"hf static batch {b}: {hf[b]}", flush=True)
    best = max(hf.values(), key=lambda r: r["tok_s"]) if hf else None
    rows = [["batcher engine", f"{ours['tok_s']:.1f}", f"{ours['wall']:.1f}",
             f"{ours['p50']:.1f}", f"{ours['p99']:.1f}", f"{ours['ttft50']:.2f}", ours["peak"],
             str(ours["preempt"]), f"{ours['tok_s'] / best['tok_s']:.2f}x" if best else "-"]]
    for b, r in hf.items():
        rows.append([f"transformers static, batch {b}", f"{r['tok_s']:.1f}", f"{r['wall']:.1f}",
                     f"{r['p50']:.1f}", f"{r['p99']:.1f}", "-", "-", "-",
                     f"{r['tok_s'] / best['tok_s']:.2f}x"])
    n = len(work)
    threads = f", {torch.get_num_threads()} torch threads"
    if args.no_append:
        print(rows)
        return
    text = append_rows(
        f"Engine vs transformers static batching: chat{n}, {args.dtype}, all at t=0{threads}",
        ["system", "output tok/s", "wall s", "p50 latency s", "p99 latency s", "p50 TTFT s",
         "peak KV blocks", "preemptions", "vs best HF"], rows,
        notes=f"Every request generated exactly its max_new_tokens: {ours['exact']}.")
    print(text)

