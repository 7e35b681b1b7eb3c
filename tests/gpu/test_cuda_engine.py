"""The CUDA path: same engine, fused kernel and CUDA graphs, equal to transformers in fp32."""

from __future__ import annotations

import asyncio

import pytest
import torch

from batcher.config import CacheConfig, SchedulerConfig
from batcher.engine import AsyncEngine
from batcher.models.loader import load_model
from batcher.request import Request
from batcher.runtime.model_runner import ModelRunner
from batcher.sampling import SamplingParams
from batcher.tokenizer import load_tokenizer
from tests.greedy_loop import greedy_generate
from tests.test_smollm_reference import CHAT_PROMPTS, NEW_TOKENS, chat_ids

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_fp32():
    return load_model("smollm2-135m", dtype="float32", device="cuda")


def test_greedy_equals_hf_on_cuda(cuda_fp32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batcher.bundled import smollm2_gguf_path

    path = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32).cuda().eval()
    prompts = [chat_ids(tok, p) for p in CHAT_PROMPTS]
    runner = ModelRunner(cuda_fp32, num_blocks=128, block_size=16)
    assert runner.backend == "triton" and runner.graphs is not None
    ours = greedy_generate(runner, prompts, NEW_TOKENS, suppress=(tok.eos_token_id,))
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([prompt], device="cuda")
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          pad_token_id=tok.eos_token_id)
        assert got == out[0, len(prompt):].tolist()


def test_graphs_equal_eager(cuda_fp32):
    prompts = [[100 + 3 * i + j for j in range(20 + 11 * i)] for i in range(5)]
    eager = ModelRunner(cuda_fp32, 128, 16, cuda_graphs=False)
    graphed = ModelRunner(cuda_fp32, 128, 16, cuda_graphs=True)
    assert greedy_generate(graphed, prompts, 24) == greedy_generate(eager, prompts, 24)


def test_engine_sizes_kv_from_free_memory_and_serves():
    loaded = load_model("smollm2-135m", dtype="bfloat16", device="cuda")
    tok = load_tokenizer(loaded.tokenizer_source)
    engine = AsyncEngine.from_loaded(loaded, tok, SchedulerConfig(max_num_seqs=256,
                                     max_num_batched_tokens=8192), CacheConfig())
    assert engine.kv.num_total_blocks > 10_000  # tens of GB of an H200-class card

    async def run():
        await engine.start()
        outs = []
        for i in range(8):
            req = Request(f"g{i}", tok.encode(f"Count to {i}:"), SamplingParams(
                max_tokens=16, temperature=0.0, ignore_eos=True))
            outs.append([ev async for ev in engine.generate(req)][-1])
        await engine.stop()
        return outs

    finals = asyncio.run(run())
    assert all(f.finish_reason == "length" and f.num_output_tokens == 16 for f in finals)
