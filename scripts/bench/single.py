"""Load time and single-sequence decode speed, ours next to `transformers`, fp32 and bf16.

    python -m scripts.bench single [--new-tokens 128]

A 100-token prompt then greedy decoding; ours runs through the engine (one request).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time

import torch

from batcher.bench.common import append_rows, load_workload
from batcher.core.config import CacheConfig, SchedulerConfig
from batcher.core.request import Request
from batcher.core.sampling import SamplingParams
from batcher.engine.engine import AsyncEngine
from batcher.models.loader import load_model
from batcher.tokenizer.tokenizer import load_tokenizer
from scripts.bench._shared import parser


async def ours(loaded, tok, prompt: list[int], new: int) -> float:
    engine = AsyncEngine.from_loaded(loaded, tok, SchedulerConfig(), CacheConfig(num_blocks=64))
    await engine.start()
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    async for _ in engine.generate(Request("warm", prompt[:8], SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True))):
        pass
    times = []
    async for ev in engine.generate(Request("one", prompt, sp)):
        times = ev.token_times or times
    await engine.stop()
    return (len(times) - 1) / (times[-1] - times[0])  # decode tokens/s after the first


def hf(loaded, prompt: list[int], new: int) -> float:
    from tests.hf_reference import hf_model_from_gguf

    model = hf_model_from_gguf(loaded)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        first = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        total = time.perf_counter() - t
    return (new - 1) / (total - first)


def main(argv: list[str]) -> None:
    ap = parser(__name__, __doc__, raw=True)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    prompt = next(r for r in load_workload() if len(r["prompt_ids"]) >= 100)["prompt_ids"][:100]
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        os.environ["BATCHER_CACHE"] = cache
        cold = load_model("smollm2-135m", dtype="bfloat16", device="cpu").load_seconds
        warm = load_model("smollm2-135m", dtype="bfloat16", device="cpu").load_seconds
    rows.append(["load (bf16): first start, dequantizing the GGUF", f"{cold:.1f} s", ""])
    rows.append(["load (bf16): later starts, from the dense cache", f"{warm:.2f} s", ""])
    del os.environ["BATCHER_CACHE"]
    for dtype in ("float32", "bfloat16"):
        loaded = load_model("smollm2-135m", dtype=dtype, device="cpu")
        tok = load_tokenizer(loaded.tokenizer_source)
        a = asyncio.run(ours(loaded, tok, prompt, args.new_tokens))
        b = hf(loaded, prompt, args.new_tokens)
        rows.append([f"single-stream decode, {dtype}, 100 in / {args.new_tokens} out",
                     f"{a:.1f} tok/s (transformers {b:.1f})", f"{a / b:.2f}x"])
        print(rows[-1], flush=True)
    print(append_rows("Load time and single-stream decode, bundled model",
                      ["what", "measured", "vs transformers"], rows))

