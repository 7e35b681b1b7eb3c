"""Oracle on the real bundled model: our batched greedy tokens equal Hugging Face's, fp32."""

from __future__ import annotations

import pytest
import torch

from batcher.runtime.model_runner import ModelRunner
from tests.greedy_loop import greedy_generate

pytestmark = pytest.mark.slow

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue? Answer briefly, please, as if to a child of five.",
    "Give me a recipe idea using eggs and spinach.",
    "What does a CPU cache do?",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_smollm():
    """transformers' own GGUF loader (its own dequantization and rotary un-permutation)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batcher.bundled import smollm2_gguf_path

    path = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    return tok, model.eval()


def chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                  add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_batched_greedy_equals_hf(smollm_fp32, hf_smollm):
    tok, hf = hf_smollm
    prompts = [chat_ids(tok, p) for p in CHAT_PROMPTS]
    runner = ModelRunner(smollm_fp32, num_blocks=64, block_size=16)
    # HF's min_new_tokens suppresses EOS; do the same so all 32 tokens are compared.
    ours = greedy_generate(runner, prompts, NEW_TOKENS, suppress=(tok.eos_token_id,))
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                              dtype=torch.long), max_new_tokens=NEW_TOKENS, do_sample=False,
                              min_new_tokens=NEW_TOKENS, pad_token_id=tok.eos_token_id)
        assert got == out[0, len(prompt):].tolist(), tok.decode(prompt)


def test_prompt_logprobs_equal_hf(smollm_fp32, hf_smollm) -> None:
    """Prompt logprobs through the engine (8-token chunks) equal transformers' log_softmax."""
    import asyncio

    from tests.test_prompt_logprobs import score_prompts

    tok, hf = hf_smollm
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. Paris is the capital of")
    ours, _ = asyncio.run(score_prompts(smollm_fp32, [prompt], budget=8, top=5))
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    want = ref[:-1].gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    got = torch.tensor([e.logprob for e in ours[0]])
    assert len(got) == len(prompt) - 1
    assert torch.allclose(got, want, atol=1e-3), (got - want).abs().max()
    got_top = torch.tensor([[v for _, v in e.top] for e in ours[0]])
    assert torch.allclose(got_top, ref[:-1].topk(5, dim=-1).values, atol=1e-3)
