"""The architectures that load, each as the few ways it differs from Llama, read from a Hugging
Face `config.json` through transformers' own config class (its defaults, its older spellings:
`rope_scaling` or `rope_parameters`, `sliding_window_pattern` or `layer_types`).

A config of any other architecture fails with one line naming it and the supported ones.
"""

from __future__ import annotations

from typing import Any

from batcher.models import rope
from batcher.models.errors import ModelLoadError
from batcher.models.llama import LlamaConfig

# Hugging Face architecture -> its `model_type`.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text", "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    # Image-text checkpoints served for text: their language model alone.
    "Gemma3ForConditionalGeneration": "gemma3_text",
}
# Image-text architecture -> the text-only one its `text_config` describes.
TEXT_PART = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
QK_NORM = {"qwen3", "qwen3_moe", "gemma3_text"}
GEMMA = {"gemma2", "gemma3_text"}
# Gemma stores its norms' weights as w for a scale of (1 + w); the model keeps 1 + w.
NORM_PLUS_ONE = GEMMA


def unsupported(what: object) -> ModelLoadError:
    return ModelLoadError(f"unsupported architecture {what}; supported: "
                          f"{', '.join(sorted(ARCHITECTURES))}")


def architecture_of(raw: dict[str, Any]) -> str:
    """The supported architecture a `config.json` dict names, or a ModelLoadError."""
    archs = raw.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return a
    raise unsupported(sorted(archs) or raw.get("model_type"))


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """An image-text checkpoint's `text_config` as a text model's config (its top level decides
    whether the LM head is the embedding table); any other config as it is."""
    arch = architecture_of(raw)
    if arch not in TEXT_PART:
        return raw
    text = dict(raw.get("text_config") or {})
    text["architectures"] = [TEXT_PART[arch]]
    if "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return text


def hf_config_object(raw: dict[str, Any]) -> Any:
    """transformers' config class of the architecture, read from `raw`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    raw = text_config(raw)
    model_type = ARCHITECTURES[architecture_of(raw)]
    return CONFIG_MAPPING[model_type].from_dict(dict(raw, model_type=model_type))


def config_from_hf(raw: dict[str, Any]) -> LlamaConfig:
    """Our config for a Hugging Face `config.json` dict of a supported architecture."""
    arch = architecture_of(raw)
    kind = ARCHITECTURES[arch]
    hf = hf_config_object(raw)
    get = hf.__dict__.get  # attributes as the config class settled them
    layers = hf.num_hidden_layers
    heads = hf.num_attention_heads
    params = dict(get("rope_parameters") or get("rope_scaling") or {})
    local = None
    if "full_attention" in params:  # per layer type (Gemma 3)
        local = params.get("sliding_attention") or {}
        params = dict(params["full_attention"] or {})
    theta = params.pop("rope_theta", None) or get("rope_theta") or 10000.0
    if (params.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ModelLoadError(f"{arch}: partial rotary embeddings are not supported")
    if get("original_max_position_embeddings") and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = get("original_max_position_embeddings")
    rope_kind = params.get("rope_type", params.get("type")) or "default"
    eos = get("eos_token_id")
    window = get("sliding_window") or None
    max_pos = get("max_position_embeddings") or 2048
    layer_types = get("layer_types")
    if window is None or window >= max_pos:
        sliding: tuple[int, ...] = ()
        window = None
    elif layer_types is not None:
        sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    else:
        sliding = tuple(range(layers))  # Mistral, Phi-3, Mixtral: every layer
    if not sliding:
        window = None
    try:  # a scaling the model cannot compute fails now, not at its first step
        rope.inv_freq(params, float(theta), get("head_dim") or hf.hidden_size // heads, max_pos)
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{arch}: {exc}") from exc
    cfg = LlamaConfig(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=get("intermediate_size") or 0, num_layers=layers, num_heads=heads,
        num_kv_heads=get("num_key_value_heads") or heads,
        head_dim=get("head_dim") or hf.hidden_size // heads,
        rms_norm_eps=get("rms_norm_eps") or 1e-6, rope_theta=float(theta),
        rope_scaling=None if rope_kind == "default" else params,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        attention_bias=bool(get("attention_bias") or get("qkv_bias") or kind == "qwen2"),
        bos_token_id=get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        architecture=arch,
        hidden_act=get("hidden_activation") or get("hidden_act") or "silu",
        qk_norm=kind in QK_NORM,
        sliding_window=window, sliding_layers=sliding,
    )
    if kind in GEMMA:
        cfg.embed_scale = hf.hidden_size ** 0.5
        cfg.sandwich_norms = True
        cfg.query_scale = get("query_pre_attn_scalar") ** -0.5
        cfg.attn_softcap = get("attn_logit_softcapping")
        cfg.final_softcap = get("final_logit_softcapping")
        if local is not None and sliding:
            cfg.local_rope_theta = float(local.get("rope_theta") or get("rope_local_base_freq")
                                         or 10000.0)
    if kind == "mixtral":
        cfg.num_experts, cfg.experts_per_tok = hf.num_local_experts, hf.num_experts_per_tok
        cfg.moe_intermediate_size = hf.intermediate_size
        cfg.moe_layers = tuple(range(layers))
    elif kind in ("qwen2_moe", "qwen3_moe"):
        cfg.num_experts, cfg.experts_per_tok = hf.num_experts, hf.num_experts_per_tok
        cfg.moe_intermediate_size = hf.moe_intermediate_size
        cfg.norm_topk_prob = bool(get("norm_topk_prob"))
        cfg.shared_expert_size = get("shared_expert_intermediate_size") or 0
        step = get("decoder_sparse_step") or 1
        dense = set(get("mlp_only_layers") or ())
        cfg.moe_layers = tuple(i for i in range(layers)
                               if i not in dense and (i + 1) % step == 0)
    return cfg
