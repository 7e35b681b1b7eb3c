"""Read a Llama-architecture GGUF file into a config and dense tensors in Hugging Face names."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from batcher.models.errors import ModelLoadError
from batcher.models.llama import LlamaConfig

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """GGUF stores Q and K rows interleaved per head for its rotary layout; undo it so the
    rotate-half RoPE of the reference applies. w: [n_heads * head_dim, hidden]."""
    out_dim = w.shape[0]
    return (w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def read_gguf(path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {path.name}: {exc}") from exc
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: 'llama'")
    heads = int(_field(reader, "llama.attention.head_count"))
    kv_heads = int(_field(reader, "llama.attention.head_count_kv", heads))
    hidden = int(_field(reader, "llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    cfg = LlamaConfig(
        vocab_size=int(_field(reader, "llama.vocab_size", 0)) or
        len(_field(reader, "tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=heads, num_kv_heads=kv_heads,
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        base, _, kind = t.name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk":
            hf = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
        elif base in _TOP_NAMES:
            hf = f"{_TOP_NAMES[base]}.{kind}"
        else:
            continue
        arr = dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(np.array(arr, dtype=np.float32))  # own, writable copy
        if base.endswith("attn_q"):
            w = unpermute_rotary(w, heads)
        elif base.endswith("attn_k"):
            w = unpermute_rotary(w, kv_heads)
        state[hf] = w
    return cfg, state
