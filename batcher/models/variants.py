"""The Llama-family architectures that differ from Llama in a few declared ways (`LlamaConfig`'s
variant fields), built from the same parts at load time so that a plain Llama model keeps its
own classes and step:

- Qwen3, Gemma 3: an RMSNorm over each Q and K head before RoPE (`qk_norm`);
- Gemma 2 and 3: embeddings times sqrt(hidden), GeGLU (gelu-tanh) MLPs, a norm after attention
  and after the MLP as well as before each (`sandwich_norms`), the attention scale
  `query_pre_attn_scalar`^-0.5, tanh soft-capping of attention scores and of the logits
  (Gemma 2), interleaved sliding-window and global layers, and a RoPE base of their own for the
  windowed layers (Gemma 3). Gemma's norms scale by (1 + weight): the loaders store 1 + weight,
  as GGUF files do, so one RMSNorm serves every model;
- Mistral, Phi-3: a sliding window on every layer;
- Mixtral, Qwen2-MoE, Qwen3-MoE: sparse mixture-of-experts MLPs (`batcher.models.moe`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batcher.models.llama import (
    MLP,
    Attention,
    DecoderLayer,
    LlamaConfig,
    LlamaModel,
    RMSNorm,
    RotaryTables,
)
from batcher.models.moe import SparseMoE
from batcher.runtime.attention import AttentionMetadata
from batcher.runtime.variant_attention import AttentionVariant, variant_attention
from batcher.runtime.token_ops import apply_rope, rms_norm


class HeadNorm(RMSNorm):
    """RMSNorm over each head's vector (x: [T, heads, head_dim]); always the torch op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class VariantAttention(Attention):
    """Attention with Q/K head norms, a window, its own scale or soft-capped scores."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.q_norm = HeadNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = HeadNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.spec = AttentionVariant(cfg.window_of(layer_idx), cfg.query_scale, cfg.attn_softcap)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        # x: [T, hidden]
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = variant_attention(q, k, v, kv_cache, meta, self.spec)  # [T, heads * head_dim]
        return self.o_proj(out)


class GeluMLP(MLP):
    """GeGLU: gelu (tanh approximation) on the gate."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2/3: each block's output is normed too before the residual add."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int, attn: nn.Module, mlp: nn.Module):
        super().__init__(cfg, layer_idx, attn, mlp)
        # Hugging Face names: post_attention_layernorm follows attention here, and the MLP has
        # a norm on each side.
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, meta, kv_cache):
        h = self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class VariantModel(LlamaModel):
    """A `LlamaModel` whose layers are built from the config's variant fields, with Gemma's
    embedding scale, per-layer RoPE tables and final soft-capping."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg)
        self._local_rope: RotaryTables | None = None

    def make_layer(self, cfg: LlamaConfig, layer_idx: int) -> nn.Module:
        attn = Attention(cfg, layer_idx) if cfg.plain_attention else VariantAttention(
            cfg, layer_idx)
        mlp: nn.Module
        if cfg.num_experts and layer_idx in cfg.moe_layers:
            mlp = SparseMoE(cfg)
        elif cfg.hidden_act == "silu":
            mlp = MLP(cfg)
        elif cfg.hidden_act in ("gelu_pytorch_tanh", "gelu_tanh"):
            mlp = GeluMLP(cfg)
        else:
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}")
        layer_cls = SandwichDecoderLayer if cfg.sandwich_norms else DecoderLayer
        layer = layer_cls(cfg, layer_idx, attn, mlp)
        # Which RoPE table the layer reads: Gemma 3's windowed layers have a base of their own.
        layer.local_rope = cfg.local_rope_theta is not None and cfg.window_of(layer_idx) is not None
        return layer

    def rotaries(self) -> tuple[RotaryTables, RotaryTables | None]:
        """The global table, and the windowed layers' own one (Gemma 3) or None."""
        if self._local_rope is None and self.config.local_rope_theta is not None:
            w = self.norm.weight
            self._local_rope = RotaryTables(self.config, self.config.max_position_embeddings,
                                            w.device, w.dtype, local=True)
        return self.rotary(), self._local_rope

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_indices: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        x = self.embed_tokens(input_ids)  # [T, hidden]
        if cfg.embed_scale is not None:
            # In the activations' dtype, as Gemma rounds it.
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        glob, local = self.rotaries()
        tables = {False: glob.lookup(positions)}
        if local is not None:
            tables[True] = local.lookup(positions)
        for layer, kv in zip(self.layers, kv_caches):
            cos, sin = tables[layer.local_rope]
            x = layer(x, cos, sin, meta, kv)
        x = self.norm(x.index_select(0, logits_indices))
        logits = self.lm_head(x).float()
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits


def build_model(cfg: LlamaConfig) -> LlamaModel:
    """The module for `cfg`, weights uninitialised (build under `torch.device("meta")` and
    assign): a plain `LlamaModel` for Llama's shapes, else a `VariantModel`."""
    return LlamaModel(cfg) if cfg.is_llama else VariantModel(cfg)
