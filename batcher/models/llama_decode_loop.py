"""A plain Llama model's decode-only step on the CPU as one loop over its layers' parts.

Through the modules, a one-row decode step of the bundled model (int4, bf16) spent about a third
of its time outside the arithmetic: some thirteen module calls a layer, each through
`nn.Module.__call__`, and torch ops for the residual adds, SiLU and its product. This loop calls
the projections' own `forward` directly and the C kernels (`batcher.runtime.fused_decode`) for
everything between them, eight calls a layer:

    norm (the previous layer's residual add folded in) -> QKV projection -> attention (RoPE and
    the cache write in it) -> output projection -> add + norm -> gate/up projection ->
    SiLU(gate) * up -> down projection

The adds round as torch's do and the norms are the same kernel as the modules', so the step
computes the modules' function; only SiLU's exponential is the kernel's own (about 1e-7
relative), which can move an activation by one bf16 step (tests/test_fused_decode.py).

Taken by decode-only steps of at most `fused_decode.NORM_MAX_ROWS` rows, in bf16, with the
fused attention kernel, for a model built of the plain Llama classes only: the variants (head
norms, sandwich norms, GeGLU, mixtures of experts) keep the module path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from batcher.models.llama import MLP, Attention, DecoderLayer, LlamaModel, RMSNorm
from batcher.runtime.attention import AttentionMetadata
from batcher.runtime.fused_decode import FusedDecode
from batcher.runtime.quant import Int8Embedding

if TYPE_CHECKING:
    from collections.abc import Callable

    Projection = Callable[[torch.Tensor], torch.Tensor]


class DecodeLoop:
    """`run(...)` for the steps `takes(...)` accepts; made by `for_model`."""

    def __init__(self, model: LlamaModel, kernels: FusedDecode) -> None:
        cfg = model.config
        self.kernels = kernels
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # Bound at attach time: the loader attaches the loop after every weight is in place.
        self.layers: list[tuple[torch.Tensor, float, Projection, Projection, torch.Tensor, float,
                                Projection, Projection]] = [
            (layer.input_layernorm.weight, layer.input_layernorm.eps,
             layer.self_attn.qkv_proj.forward, layer.self_attn.o_proj.forward,
             layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
             layer.mlp.gate_up_proj.forward, layer.mlp.down_proj.forward)
            for layer in model.layers]
        self.final_norm = (model.norm.weight, model.norm.eps)
        self.lm_head = model.lm_head.forward

    @staticmethod
    def for_model(model: nn.Module, kernels: FusedDecode) -> DecodeLoop | None:
        """The loop for `model`, or None where it is not built of the plain Llama classes."""
        # The embedding's lookup must be a tensor of its own: the loop sums into it in place.
        plain = (type(model) is LlamaModel and type(model.norm) is RMSNorm
                 and type(model.embed_tokens) in (nn.Embedding, Int8Embedding)) and all(
            type(layer) is DecoderLayer and type(layer.self_attn) is Attention
            and type(layer.mlp) is MLP and type(layer.input_layernorm) is RMSNorm
            and type(layer.post_attention_layernorm) is RMSNorm for layer in model.layers)
        return DecodeLoop(model, kernels) if plain else None

    def takes(self, x: torch.Tensor, meta: object) -> bool:
        """Whether a step whose embedded rows are `x` runs here: decode rows only, through the
        fused attention, few enough for the single-threaded norms."""
        return (type(meta) is AttentionMetadata and meta.fused is not None
                and meta.num_decodes == x.shape[0] and self.kernels.takes_norm(x))

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            logits_indices: torch.Tensor) -> torch.Tensor:
        """x: the step's embedded rows [T, hidden], a tensor of its own (the residual stream is
        summed into it in place) -> logits [N, vocab] of the rows `logits_indices` names."""
        k, step = self.kernels, meta.fused
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        delta = None  # the residual branch not yet added into x
        for (in_w, in_eps, qkv_proj, o_proj, post_w, post_eps, gate_up_proj,
             down_proj), kv in zip(self.layers, kv_caches):
            h = (k.rms_norm(x, in_w, in_eps) if delta is None
                 else k.add_rms_norm(x, delta, in_w, in_eps))
            attn = k.attend(qkv_proj(h), cos, sin, kv, step, heads, kv_heads, head_dim)
            h = k.add_rms_norm(x, o_proj(attn), post_w, post_eps)
            delta = down_proj(k.silu_mul(gate_up_proj(h)))
        w, eps = self.final_norm
        h = k.rms_norm(x, w, eps) if delta is None else k.add_rms_norm(x, delta, w, eps)
        # Per-row norms: normalising every row, then picking, is picking, then normalising.
        return self.lm_head(h.index_select(0, logits_indices)).float()
