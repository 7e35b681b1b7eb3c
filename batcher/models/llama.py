"""The Llama family (Llama, SmolLM, TinyLlama, Qwen2 shapes) in one readable file.

The model runs one flattened varlen batch: `input_ids[T]` and `positions[T]` drawn from many
sequences at once, reading and writing a paged KV cache through `AttentionMetadata`, and returns
logits only for the rows asked for. Q/K/V and gate/up projections are fused into one matmul each.
Architectures that differ in a few declared ways (Qwen3, Gemma 2/3, Phi-3, Mistral's window,
the MoE models) set `LlamaConfig`'s variant fields and are built by `batcher.models.variants`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from batcher.models import rope
from batcher.runtime.attention import AttentionMetadata, paged_attention
from batcher.runtime.fused_decode import FusedDecode
from batcher.runtime.token_ops import apply_rope, rms_norm


@dataclass(slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # What differs from Llama, all off by default (`batcher.models.arch` fills them from a
    # Hugging Face config or a GGUF header; `batcher.models.variants` builds them).
    architecture: str = "LlamaForCausalLM"
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh" (Gemma's GeGLU)
    qk_norm: bool = False  # RMSNorm over each Q and K head before RoPE (Qwen3, Gemma 3)
    embed_scale: float | None = None  # embeddings times sqrt(hidden) (Gemma)
    sandwich_norms: bool = False  # norms after attention and MLP too (Gemma 2 and 3)
    query_scale: float | None = None  # attention scale when not 1/sqrt(head_dim) (Gemma)
    attn_softcap: float | None = None  # tanh cap on attention scores (Gemma 2)
    final_softcap: float | None = None  # tanh cap on the logits (Gemma 2)
    sliding_window: int | None = None  # keys a windowed layer sees, its own token included
    sliding_layers: tuple[int, ...] = ()  # the layers that use it
    local_rope_theta: float | None = None  # the windowed layers' own RoPE base (Gemma 3)
    num_experts: int = 0  # > 0: mixture-of-experts MLPs (`batcher.models.moe`)
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router weights
    shared_expert_size: int = 0  # Qwen2-MoE's gated shared expert
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is sparse

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def kv_window(self) -> int | None:
        """The window when every layer has it: blocks behind it are never read again. With
        some global layers (Gemma's interleaved ones) every block stays."""
        return self.sliding_window if len(self.sliding_layers) == self.num_layers else None

    @property
    def plain_attention(self) -> bool:
        """Attention as Llama computes it: what the fused CPU and Triton decode kernels, CUDA
        graphs and the compiled decode step implement."""
        return not (self.qk_norm or self.sliding_layers or self.query_scale is not None
                    or self.attn_softcap is not None or self.local_rope_theta is not None)

    @property
    def is_llama(self) -> bool:
        """Nothing but Llama's layers: the model is a plain `LlamaModel`."""
        return (self.plain_attention and self.hidden_act == "silu" and not self.num_experts
                and not self.sandwich_norms and self.embed_scale is None
                and self.final_softcap is None)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V, every layer: 2 x layers x kv_heads x head_dim x bytes."""
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def num_parameters(self) -> int:
        """Weights of the model this config describes, counted from its shapes (a tied LM head
        once): what `LlamaModel` holds, without building it."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if self.attention_bias else 0)
        attn += 2 * d if self.qk_norm else 0
        norms = (4 if self.sandwich_norms else 2) * h
        dense = 3 * h * self.intermediate_size
        sparse = (self.num_experts * (3 * h * self.moe_intermediate_size + h)
                  + (3 * h * self.shared_expert_size + h if self.shared_expert_size else 0))
        n_moe = len(self.moe_layers) if self.num_experts else 0
        layers = self.num_layers * (attn + norms) + n_moe * sparse + (
            self.num_layers - n_moe) * dense
        heads = 1 if self.tie_word_embeddings else 2  # embedding table, LM head
        return layers + heads * self.vocab_size * h + h  # + final norm

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """From a Llama-shaped Hugging Face `config.json` dict (`batcher.models.arch` reads
        every supported architecture's)."""
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", cfg.get("model_type") == "qwen2"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] of `cfg`'s RoPE (its scaling: `batcher.models.rope`)."""
    return rope.inv_freq(cfg.rope_scaling, cfg.rope_theta, cfg.head_dim,
                         cfg.max_position_embeddings)[0]


class RotaryTables:
    """cos/sin for every position up to max_len, built once in the layout `apply_rope` reads, so
    a step only indexes them: halves repeated, and sin's first half negated (the sign of the
    rotate-half convention). `local`: the windowed layers' own base (Gemma 3), unscaled."""

    def __init__(self, cfg: LlamaConfig, max_len: int, device: torch.device, dtype: torch.dtype,
                 local: bool = False):
        params, theta = ((None, cfg.local_rope_theta) if local
                         else (cfg.rope_scaling, cfg.rope_theta))
        cos, sin = rope.rope_tables(params, theta, cfg.head_dim, max_len,
                                    cfg.max_position_embeddings)  # [max_len, head_dim / 2]
        self.cos = torch.cat((cos, cos), -1).to(device=device, dtype=dtype)  # [max_len, head_dim]
        self.sin = torch.cat((-sin, sin), -1).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # -> cos, sin: [T, 1, head_dim]
        return (self.cos.index_select(0, positions).unsqueeze(1),
                self.sin.index_select(0, positions).unsqueeze(1))


class RMSNorm(nn.Module):
    fused: FusedDecode | None = None  # the C kernel for small bf16 steps: see `attach_fused`

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.fused
        if fused is not None and fused.takes_norm(x) and not torch.compiler.is_compiling():
            return fused.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        # x: [T, hidden]
        return self.attend(self.qkv_proj(x), cos, sin, meta, kv_cache)

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]
               ) -> torch.Tensor:
        """From the QKV projection's output [T, q_size + 2 * kv_size] on: RoPE, the cache
        write, attention and the output projection."""
        t = qkv.shape[0]
        if isinstance(meta, AttentionMetadata) and meta.fused is not None and \
                meta.num_decodes == t:
            # A decode-only step on the CPU: RoPE, the cache write and attention in one call.
            return self.o_proj(meta.fused.kernels.attend(
                qkv, cos, sin, kv_cache, meta.fused, self.num_heads, self.num_kv_heads,
                self.head_dim))
        # Q and K heads lie side by side in the fused projection: one RoPE call rotates both.
        qk_end = self.q_size + self.kv_size
        qk = apply_rope(qkv[:, :qk_end].view(t, -1, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_end:].view(t, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, meta)  # [T, heads * head_dim]
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int, attn: nn.Module | None = None,
                 mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attn if attn is not None else Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else MLP(cfg)

    def forward(self, x, cos, sin, meta, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def attach_fused(model: nn.Module, kernels: FusedDecode) -> int:
    """Let every RMSNorm of `model` run small bf16 steps through `kernels` (decode attention
    takes them through the step's metadata, `AttentionMetadata.fused`). Returns how many."""
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    for m in norms:
        m.fused = kernels
    return len(norms)


class LayerFastPath(Protocol):
    """Another way to run some steps of the model, after the embedding lookup
    (`batcher.models.llama_layer_loop.LayerLoop`)."""

    def takes(self, x: torch.Tensor, meta: object) -> bool: ...

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            logits_indices: torch.Tensor) -> torch.Tensor: ...


class LlamaModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head."""

    # Steps of a plain model through one loop over its layers' parts: `llama_layer_loop`.
    layer_loop: LayerFastPath | None = None

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        # Uninitialised: the loader assigns every weight. (nn.Embedding's own random init, run on
        # the meta device the loader builds on, costs ~65 MiB of resident memory per process.)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._rope: RotaryTables | None = None

    def make_layer(self, cfg: LlamaConfig, layer_idx: int) -> nn.Module:
        return DecoderLayer(cfg, layer_idx)

    def rotary(self) -> RotaryTables:
        if self._rope is None:
            w = self.norm.weight  # dense in the model's dtype even when the table is quantized
            self._rope = RotaryTables(self.config, self.config.max_position_embeddings,
                                      w.device, w.dtype)
        return self._rope

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; logits_indices: [N] rows to project -> logits [N, vocab]."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary().lookup(positions)  # built once per step for all layers
        loop = self.layer_loop
        if loop is not None and loop.takes(x, meta):
            return loop.run(x, cos, sin, meta, kv_caches, logits_indices)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, meta, kv)
        x = self.norm(x.index_select(0, logits_indices))  # only rows that sample
        return self.lm_head(x).float()
