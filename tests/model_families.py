"""Tiny random models of every supported architecture, built with transformers' own classes, and
the greedy reference they must reproduce."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
WINDOW = 12  # smaller than the prompts and the 16-token blocks: windows cut inside blocks


def family_configs() -> dict[str, object]:
    """name -> a transformers config of that architecture, small enough for a CPU test, with
    every feature the family has switched on (windows, soft-caps, scaled RoPE, shared experts,
    dense layers among sparse ones)."""
    import transformers as tf

    return {
        "qwen3": tf.Qwen3Config(**COMMON, head_dim=16),
        "mistral": tf.MistralConfig(**COMMON, sliding_window=WINDOW),
        "gemma2": tf.Gemma2Config(**(COMMON | dict(num_hidden_layers=3)), head_dim=32,
                                  query_pre_attn_scalar=24, sliding_window=WINDOW,
                                  attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
        "gemma3": tf.Gemma3TextConfig(
            **(COMMON | dict(num_hidden_layers=3)), head_dim=32, query_pre_attn_scalar=32,
            sliding_window=WINDOW, sliding_window_pattern=2, rope_local_base_freq=100.0,
            rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}),
        "phi3": tf.Phi3Config(**COMMON, original_max_position_embeddings=64, rope_scaling={
            "rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)]}),
        "mixtral": tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": tf.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32,
                                       shared_expert_intermediate_size=48, mlp_only_layers=[1],
                                       norm_topk_prob=False),
        "qwen3_moe": tf.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=32,
                                       decoder_sparse_step=2, norm_topk_prob=True),
    }


def build_hf(name: str, seed: int = 0):
    """The transformers model of `family_configs()[name]` with wide random weights (matrices
    ~ N(0, 1/fan_in), norms around their identity), so greedy choices sit far from near-ties."""
    from transformers import AutoModelForCausalLM

    cfg = family_configs()[name]
    cfg._attn_implementation = "eager"  # the reference math (Gemma 2's soft-cap needs it)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    gemma = name.startswith("gemma")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if pname.endswith("norm.weight"):
                p.copy_(0.1 * noise if gemma else 1.0 + 0.1 * noise)  # Gemma scales by 1 + w
            elif pname.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)
    return model


def save_folder(model, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens by full forwards, no cache: the plainest reading of the reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]
