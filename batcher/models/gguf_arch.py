"""A GGUF file's architecture: its header's `{arch}.*` keys as our config, and its tensor names as
Hugging Face's. The names and conventions are llama.cpp's (`gguf`'s constants):

- `llama` (and Mixtral, a `llama` file with experts; Mistral, one with
  `llama.attention.sliding_window`): Q and K rows permuted per head for
  llama.cpp's rotary layout (undone on reading); every other architecture keeps them as stored;
- `qwen2`, `qwen3` (Q/K norms), `phi3` (fused `attn_qkv`, and `ffn_up` holding gate then up;
  LongRoPE factors as tensors `rope_factors_short`/`rope_factors_long`);
- `gemma2`, `gemma3`: `ffn_norm` is the norm before the MLP, `post_attention_norm` and
  `post_ffw_norm` the ones after; norm weights are stored as 1 + w already. The attention scale
  is not in the header: 1/sqrt(head_dim), except the 27B models' 1/sqrt(hidden / heads), told
  apart by their layer count, as llama.cpp does. Windowed layers: the header's pattern, else
  Gemma 2's every other layer from the first, Gemma 3's five of every six; Gemma 3's windowed
  layers turn with a base of 10000 unless the header gives one;
- `qwen2moe` (a shared expert with a sigmoid gate), `qwen3moe`: experts stacked per layer in
  `ffn_{gate,up,down}_exps`, the router in `ffn_gate_inp`.
"""

from __future__ import annotations

import numpy as np

from batcher.models.errors import ModelLoadError
from batcher.models.gguf_file import GGUFFile
from batcher.models.llama import LlamaConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
ROTARY_PERMUTED = {"llama"}
# GGUF block tensor -> Hugging Face module, where it is not `_LAYER_NAMES`' (gguf_weights).
GEMMA_NAMES = {"ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"}
PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def layer_names(arch: str) -> dict[str, str]:
    """Per-architecture overrides of the block tensor names."""
    if arch in ("gemma2", "gemma3"):
        return GEMMA_NAMES
    return PHI3_NAMES if arch == "phi3" else {}


def config(reader: GGUFFile) -> LlamaConfig:
    arch = reader.fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: "
                             f"{', '.join(sorted(ARCHITECTURES))}")

    def get(key: str, default=None):
        return reader.fields.get(f"{arch}.{key}", default)

    def need(key: str):
        """A header key the architecture cannot do without: its absence is one line."""
        v = get(key)
        if v is None:
            raise ModelLoadError(f"GGUF {arch}: the header has no '{arch}.{key}'")
        return v

    heads = int(need("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    hidden = int(need("embedding_length"))
    layers = int(need("block_count"))
    names = {t.name for t in reader.tensors}
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    head_dim = int(get("attention.key_length", 0) or get("rope.dimension_count", 0)
                   or hidden // heads)
    max_pos = int(get("context_length", 2048))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    experts = int(get("expert_count", 0) or 0)
    window = int(get("attention.sliding_window", 0) or 0)
    cfg = LlamaConfig(
        vocab_size=int(get("vocab_size", 0) or 0) or (len(tokens) if tokens is not None else 0),
        hidden_size=hidden, intermediate_size=int(get("feed_forward_length", 0) or 0),
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch, get, need, max_pos),
        max_position_embeddings=max_pos,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        architecture=_architecture(arch, experts, window),
        qk_norm="blk.0.attn_q_norm.weight" in names,
    )
    if arch in ("gemma2", "gemma3"):
        cfg.hidden_act = "gelu_pytorch_tanh"
        cfg.embed_scale = hidden ** 0.5
        cfg.sandwich_norms = True
        big = layers == _GEMMA_27B_LAYERS[arch]
        cfg.query_scale = (hidden / heads if big else head_dim) ** -0.5
        for key, attr in (("attn_logit_softcapping", "attn_softcap"),
                          ("final_logit_softcapping", "final_softcap")):
            if get(key):
                setattr(cfg, attr, float(get(key)))
        pattern = get("attention.sliding_window_pattern")
        if isinstance(pattern, np.ndarray):
            sliding = [i for i in range(layers) if bool(pattern[i])]
        else:
            every = int(pattern or (2 if arch == "gemma2" else 6))
            sliding = [i for i in range(layers) if (i + 1) % every]
        if window and window < max_pos:
            cfg.sliding_window, cfg.sliding_layers = window, tuple(sliding)
            if arch == "gemma3":
                cfg.local_rope_theta = float(get("rope.freq_base_swa", 10000.0))
    elif window and window < max_pos:  # Phi-3, Mistral: every layer
        cfg.sliding_window, cfg.sliding_layers = window, tuple(range(layers))
    if experts:
        cfg.num_experts = experts
        cfg.experts_per_tok = int(need("expert_used_count"))
        cfg.moe_intermediate_size = int(get("expert_feed_forward_length", 0) or 0) or (
            cfg.intermediate_size)
        cfg.shared_expert_size = int(get("expert_shared_feed_forward_length", 0) or 0)
        # Qwen2-MoE leaves its router weights as they fall; Mixtral and Qwen3-MoE renormalise.
        cfg.norm_topk_prob = bool(get("expert_weights_norm", arch != "qwen2moe"))
        cfg.moe_layers = tuple(i for i in range(layers)
                               if f"blk.{i}.ffn_gate_inp.weight" in names)
    return cfg


def _architecture(arch: str, experts: int, window: int) -> str:
    """llama.cpp writes Mixtral as `llama` with experts, Mistral as `llama` (with its window)."""
    if arch != "llama":
        return ARCHITECTURES[arch]
    if experts:
        return "MixtralForCausalLM"
    return "MistralForCausalLM" if window else ARCHITECTURES[arch]


def _rope_scaling(reader: GGUFFile, arch: str, get, need, max_pos: int) -> dict | None:
    kind = get("rope.scaling.type")
    orig = get("rope.scaling.original_context_length")
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_f")}
    if "rope_freqs.weight" in factors:  # Llama 3.1's scaling, as per-frequency divisors
        return {"rope_type": "freq_factors", "factors": _floats(factors["rope_freqs.weight"])}
    if "rope_factors_short.weight" in factors:  # Phi-3's LongRoPE
        if "rope_factors_long.weight" not in factors:
            raise ModelLoadError(f"GGUF {arch}: LongRoPE needs both 'rope_factors_short' and "
                                 "'rope_factors_long'; the file has only the short factors")
        params = {"rope_type": "longrope",
                  "short_factor": _floats(factors["rope_factors_short.weight"]),
                  "long_factor": _floats(factors["rope_factors_long.weight"]),
                  "original_max_position_embeddings": int(orig or max_pos)}
        if get("rope.scaling.attn_factor") is not None:
            params["attention_factor"] = float(get("rope.scaling.attn_factor"))
        return params
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(f"GGUF {arch}: unsupported rope scaling {kind!r}")
    params = {"rope_type": kind, "factor": float(need("rope.scaling.factor"))}
    if orig:
        params["original_max_position_embeddings"] = int(orig)
    return params


def _floats(t) -> list[float]:
    return [float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)]
