"""Build the Hugging Face reference model with the same weights as ours."""

from __future__ import annotations

import torch

from batcher.models.llama import LlamaConfig


def hf_config(cfg: LlamaConfig):
    from transformers import LlamaConfig as HFLlamaConfig

    return HFLlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.attention_bias,
        bos_token_id=cfg.bos_token_id, eos_token_id=list(cfg.eos_token_ids) or None)


def hf_model_from_state(cfg: LlamaConfig, hf_state: dict[str, torch.Tensor]):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(hf_config(cfg)).float().eval()
    missing, unexpected = model.load_state_dict(hf_state, strict=False)
    assert not unexpected, unexpected
    assert all("lm_head" in m for m in missing), missing
    return model


def hf_model_from_gguf(loaded):
    """transformers' Llama with the same dequantized weights as `loaded`, in its dtype."""
    from transformers import LlamaForCausalLM

    from batcher.models import gguf_weights

    _, state = gguf_weights.read_gguf(loaded.tokenizer_source)
    model = LlamaForCausalLM(hf_config(loaded.config))
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model.to(loaded.dtype).eval()
