"""The CUDA path in one go: single-stream decode, decode step time vs the memory-bandwidth floor,
and chat64 through the engine vs `transformers` static batching on the same GPU.

    python scripts/bench_gpu.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from bench_common import append_rows, load_workload
from bench_engine import run_engine, run_hf_static

from batcher.core.outputs import ScheduledSeq, SchedulerOutput
from batcher.models.loader import load_model
from batcher.runtime.model_runner import ModelRunner
from batcher.sampling import SamplingParams
from batcher.tokenizer import load_tokenizer


def bandwidth_gbs() -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t) / 1e9


def decode_step_ms(runner: ModelRunner, batch: int, ctx: int) -> float:
    sp = SamplingParams(temperature=0.0)
    nb = -(-(ctx + 1) // runner.block_size)
    sched = SchedulerOutput([ScheduledSeq(str(i), [7], ctx, list(range(i * nb, (i + 1) * nb)),
                                          True, sp) for i in range(batch)])
    for _ in range(3):
        runner.execute(sched)
    torch.cuda.synchronize()
    reps = 20
    t = time.perf_counter()
    for _ in range(reps):
        runner.execute(sched)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ctx", type=int, default=512)
    args = ap.parse_args()
    loaded = load_model("smollm2-135m", dtype="bfloat16", device="cuda")
    tok = load_tokenizer(loaded.tokenizer_source)
    bw = bandwidth_gbs()
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    kv_tok = loaded.config.kv_bytes_per_token(loaded.dtype)
    rows = []
    runner = ModelRunner(loaded, num_blocks=128 * (-(-(args.ctx + 1) // 16)), block_size=16,
                         max_graph_batch=128, max_model_len=4096)
    for b in (1, 8, 32, 128):
        ms = decode_step_ms(runner, b, args.ctx)
        floor = (weight_bytes + b * args.ctx * kv_tok) / (bw * 1e9) * 1000
        rows.append([f"decode step, batch {b}, ctx {args.ctx}", f"{ms:.3f} ms",
                     f"{floor:.3f} ms", f"{ms / floor:.2f}x", f"{b / ms * 1000:.0f} tok/s"])
    print(rows, flush=True)
    work = load_workload(None, 16 if args.quick else None)

    class A:  # the engine bench's knobs, GPU-sized
        max_num_seqs, max_num_batched_tokens, num_blocks = 256, 8192, 4096

    ours = asyncio.run(run_engine(loaded, tok, work, A))
    one = asyncio.run(run_engine(loaded, tok, [{"id": "solo", "prompt_ids": work[0]["prompt_ids"]
                                                [:100], "max_new_tokens": 128}], A))
    hf = {b: run_hf_static(loaded, work, b) for b in (8, 32, 64)}
    best = max(hf.values(), key=lambda r: r["tok_s"])
    rows.append(["single stream decode (100 in, 128 out)", f"{one['tok_s']:.0f} tok/s", "-",
                 "-", "-"])
    rows.append([f"chat{len(work)} engine", f"{ours['tok_s']:.0f} tok/s",
                 f"{ours['wall']:.2f} s wall", f"{ours['tok_s'] / best['tok_s']:.2f}x vs best HF",
                 f"p50 TTFT {ours['ttft50']:.3f} s"])
    for b, r in hf.items():
        rows.append([f"chat{len(work)} transformers static, batch {b}", f"{r['tok_s']:.0f} tok/s",
                     f"{r['wall']:.2f} s wall", "-", "-"])
    text = append_rows(f"CUDA: {torch.cuda.get_device_name()} ({bw:.0f} GB/s measured copy)",
                       ["what", "measured", "floor / detail", "ratio", "rate"], rows)
    print(text)


if __name__ == "__main__":
    main()
