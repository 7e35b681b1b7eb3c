"""The `tiny` model: a seeded random-weight Llama config (2 layers, hidden 64, GQA) with the
bundled tokenizer's vocabulary, and its weights in Hugging Face names."""

from __future__ import annotations

import torch

from batcher.models.llama import LlamaConfig


def tiny_config() -> LlamaConfig:
    # The bundled tokenizer's vocabulary, so tests can feed real text.
    return LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                       max_position_embeddings=4096, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_ids=(2,))


def tiny_state(cfg: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights in Hugging Face names. A wide init keeps greedy choices away from
    near-ties, so batch composition cannot flip them."""
    gen = torch.Generator().manual_seed(seed)
    hf = _hf_shapes(cfg)
    state = {}
    for name, shape in hf.items():
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            state[name] = torch.randn(shape, generator=gen) * (1.0 / shape[-1] ** 0.5)
    return state


def _hf_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (cfg.num_heads * d, h),
                   p + "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
                   p + "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
                   p + "self_attn.o_proj.weight": (h, cfg.num_heads * d),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
    return shapes
