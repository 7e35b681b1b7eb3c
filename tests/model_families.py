"""Tiny random models of every supported architecture, built with transformers' own classes, and
the greedy reference they must reproduce."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
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

    gemma3 = tf.Gemma3TextConfig(
        **(COMMON | dict(num_hidden_layers=3)), head_dim=32, query_pre_attn_scalar=32,
        sliding_window=WINDOW, sliding_window_pattern=2, rope_local_base_freq=100.0,
        rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    return {
        "llama3": tf.LlamaConfig(**COMMON, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        "qwen2": tf.Qwen2Config(**COMMON),
        "qwen3": tf.Qwen3Config(**COMMON, head_dim=16),
        "mistral": tf.MistralConfig(**COMMON, sliding_window=WINDOW),
        "gemma2": tf.Gemma2Config(**(COMMON | dict(num_hidden_layers=3)), head_dim=32,
                                  query_pre_attn_scalar=24, sliding_window=WINDOW,
                                  attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
        "gemma3": gemma3,
        # The image-text checkpoint (Gemma 3 4B and up), served for its text.
        "gemma3_mm": tf.Gemma3Config(
            text_config=gemma3.to_dict(), mm_tokens_per_image=4, boi_token_index=500,
            eoi_token_index=501, image_token_index=502, tie_word_embeddings=True,
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, image_size=32, patch_size=16)),
        # NOTE: every test sequence stays below the original 64 positions, so only the short
        # LongRoPE factors run end to end (the long ones are checked against transformers' init
        # in the RoPE tests). Past 64, transformers re-reads the whole sequence with the long
        # factors (its `generate` drops the cache at the crossing to do so), where a paged cache
        # keeps the K it wrote by the short ones: a 58-token prompt's 8th new token differs.
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


def build_hf(name: str, seed: int = 0, **overrides):
    """The transformers model of `family_configs()[name]` (with `overrides` set on its config)
    with wide random weights (matrices ~ N(0, 1/fan_in), norms around their identity), so greedy
    choices sit far from near-ties."""
    from transformers import AutoModelForCausalLM

    cfg = family_configs()[name]
    for key, value in overrides.items():
        setattr(cfg, key, value)
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


# Our family name -> the GGUF architecture llama.cpp writes it as (Mistral: `llama` with
# `llama.attention.sliding_window`; Mixtral: `llama` with experts).
GGUF_ARCH = {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama",
             "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "mixtral": "llama",
             "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "mlp.gate_up_proj": "ffn_up", "mlp.gate": "ffn_gate_inp",
               "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
               "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp"}


def _permute_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    # llama.cpp's converter: each head's rows interleaved (what the reader undoes).
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(name: str, model, path: Path) -> Path:
    """`model` as llama.cpp's converter would write it (fp32 tensors), with a vocabulary of
    placeholder tokens. The GGUF header has no attention scale: Gemma's must be 1/sqrt(head_dim)."""
    from gguf import GGUFWriter, RopeScalingType

    cfg = model.config
    arch = GGUF_ARCH[name]
    gemma = name.startswith("gemma")
    w = GGUFWriter(str(path), arch)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "llama3":  # as llama.cpp writes it: per-frequency divisors
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        base = 1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
        w.add_tensor("rope_freqs.weight", (base / scaled).float().numpy())
    if rope.get("rope_type") == "longrope":
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        factor = cfg.max_position_embeddings / cfg.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(
            (1 + math.log(factor) / math.log(cfg.original_max_position_embeddings)) ** 0.5)
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
        if gemma:
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if gemma3_local := cfg.rope_parameters.get("sliding_attention"):
        w.add_rope_freq_base_swa(gemma3_local["rope_theta"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, key, None):
            getattr(w, f"add_{key}")(getattr(cfg, key))
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    layer = _GGUF_LAYER | ({"post_attention_layernorm": "post_attention_norm",
                            "pre_feedforward_layernorm": "ffn_norm",
                            "post_feedforward_layernorm": "post_ffw_norm"} if gemma
                           else {"post_attention_layernorm": "ffn_norm"})
    for hf_name, t in model.state_dict().items():
        t = t.detach().float()
        if gemma and hf_name.endswith("norm.weight"):
            t = t + 1  # llama.cpp stores Gemma's (1 + w)
        if hf_name in top:
            w.add_tensor(top[hf_name], t.numpy())
            continue
        _, _, n, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1) if rest.endswith((".weight", ".bias")) else (rest, "")
        if module == "mlp.experts.gate_up_proj":  # transformers 5's stacked experts
            g, u = t.chunk(2, dim=1)
            w.add_tensor(f"blk.{n}.ffn_gate_exps.weight", g.contiguous().numpy())
            w.add_tensor(f"blk.{n}.ffn_up_exps.weight", u.contiguous().numpy())
            continue
        if module == "mlp.experts.down_proj":
            w.add_tensor(f"blk.{n}.ffn_down_exps.weight", t.numpy())
            continue
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            t = _permute_rotary(t, heads if module.endswith("q_proj") else kv_heads)
        w.add_tensor(f"blk.{n}.{layer[module]}.{kind}", t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
