"""On CUDA: after the warm start, requests of every batch size, prompt length and sampling path
compile no Triton kernel and torch.compile no graph, and the step-time model the server starts
with is the device's (calibrated), not the CPU prior's."""

from __future__ import annotations

import asyncio

import pytest

from batcher.core.config import CUDA_MAX_NUM_BATCHED_TOKENS, CacheConfig, SchedulerConfig
from batcher.core.step_time import CPU_PRIOR, StepShape
from batcher.engine.engine import AsyncEngine
from batcher.models.loader import load_model
from batcher.core.request import Request
from batcher.runtime.compile_count import compilations
from batcher.core.sampling import SamplingParams
from batcher.tokenizer.tokenizer import load_tokenizer
from batcher.engine.warmup import warm_start

pytestmark = pytest.mark.gpu


def test_a_warm_cuda_server_compiles_nothing_while_it_serves() -> None:
    # NOTE: a plain test around asyncio.run: the GPU check runs this file where only pytest is
    # carried, not pytest-asyncio (scripts/gpu_pack.py).
    asyncio.run(_warm_server_compiles_nothing())


async def _warm_server_compiles_nothing() -> None:
    lm = load_model("smollm2-135m", dtype="bfloat16", device="cuda", load_format="dummy")
    engine = AsyncEngine.from_loaded(
        lm, load_tokenizer(lm.tokenizer_source),
        SchedulerConfig(64, CUDA_MAX_NUM_BATCHED_TOKENS, 2048).validate(),
        CacheConfig(num_blocks=2048))
    try:
        report = await warm_start(engine)
        assert report.calibrate_steps > 10
        before = compilations()
        params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                  SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8, top_k=40, seed=3,
                                 ignore_eos=True),
                  SamplingParams(max_tokens=10, logprobs=3, presence_penalty=0.3,
                                 repetition_penalty=1.1, ignore_eos=True)]

        async def one(i: int, n: int) -> None:
            req = Request(f"r{i}", [1000 + (i * 7 + j) % 20000 for j in range(n)],
                          params[i % 3])
            async for _ in engine.generate(req):
                pass

        for batch in (1, 5, 37):
            await asyncio.gather(*(one(100 * batch + i, 3 + 41 * i) for i in range(batch)))
        assert compilations() == before
        # Calibrated: a one-row decode step priced as this device measured it, far below the
        # CPU prior's fixed part.
        assert engine.step_time_model.predict(StepShape(1, 64)) < CPU_PRIOR.intercept / 2
    finally:
        await engine.stop()
