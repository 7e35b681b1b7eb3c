"""A plain Llama model's steps as one loop over its layers' parts, with the ops between the
matmuls as fused kernels: the C kernels on the CPU (`batcher.runtime.fused_decode`), Triton
kernels on a GPU (`batcher.runtime.triton_norms`).

Through the modules, a one-row decode step of the bundled model (int4, bf16, CPU) spent about a
third of its time outside the arithmetic: some thirteen module calls a layer, each through
`nn.Module.__call__`, and torch ops for the residual adds, SiLU and its product; on a GPU each of
those ops is a kernel launch of its own. The loop calls the projections' own `forward` directly
and the kernels for everything between them, per layer:

    norm (the previous layer's residual add folded in) -> QKV projection -> attention and the
    output projection (the layer's own `Attention.attend`; on the CPU's decode steps RoPE, the
    cache write and attention are one C call; on a GPU, RoPE and the cache write are one Triton
    call before the attention kernels read every key from the cache) -> add + norm -> gate/up
    projection ->
    SiLU(gate) * up -> down projection

The adds round as torch's do and the norms as the modules' norms compute them, so a step computes
the modules' function; SiLU's exponential and the norms' sums are the kernels' own, which can
move an activation by one step of its type now and then (tests/test_fused_decode.py,
tests/test_triton_norms.py).

Which steps take the loop is the kernels' to say (`LayerOps.takes_layer_loop`): on the CPU,
decode-only bf16 steps of at most `fused_decode.NORM_MAX_ROWS` rows with the fused attention; on
a GPU, every bf16/fp16 step. Only a model built of the plain Llama classes has a loop: the
variants (head norms, sandwich norms, GeGLU, mixtures of experts) keep the module path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from batcher.models.llama import MLP, Attention, DecoderLayer, LlamaModel, RMSNorm
from batcher.runtime.attention import AttentionMetadata, attend_written
from batcher.runtime.quant import Int8Embedding

if TYPE_CHECKING:
    from collections.abc import Callable

    Projection = Callable[[torch.Tensor], torch.Tensor]
    Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata,
                       tuple[torch.Tensor, torch.Tensor]], torch.Tensor]


class LayerOps(Protocol):
    """The kernels the loop runs between the matmuls."""

    def takes_layer_loop(self, x: torch.Tensor, meta: object) -> bool:
        """Whether a step whose embedded rows are `x` runs through the loop."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x += delta in place, then the norm of the sum."""

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class RopeCacheOps(Protocol):
    """Ops that also take a step's RoPE and cache write in one call (the GPU's), where its
    attention then reads every key from the cache."""

    def takes_rope_cache(self, meta: AttentionMetadata, rows: int, head_dim: int) -> bool: ...

    def rope_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv_cache: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor,
                   heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
        """Q rotated [rows, heads, head_dim]; K rotated and V written at `slots`."""


class LayerLoop:
    """`run(...)` for the steps `takes(...)` accepts; made by `for_model`."""

    def __init__(self, model: LlamaModel, ops: LayerOps) -> None:
        self.ops = ops
        # Bound at attach time: the loader attaches the loop after every weight is in place.
        self.layers: list[tuple[torch.Tensor, float, Projection, Attend, torch.Tensor, float,
                                Projection, Projection]] = [
            (layer.input_layernorm.weight, layer.input_layernorm.eps,
             layer.self_attn.qkv_proj.forward, layer.self_attn.attend,
             layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
             layer.mlp.gate_up_proj.forward, layer.mlp.down_proj.forward)
            for layer in model.layers]
        self.final_norm = (model.norm.weight, model.norm.eps)
        self.lm_head = model.lm_head.forward
        attn = model.layers[0].self_attn if len(model.layers) else None
        # (heads, kv heads, head size), and each layer's output projection, where the ops take
        # RoPE and the cache write in one call: such steps then skip `Attention.attend`.
        self.rope_cache: RopeCacheOps | None = ops if (
            attn is not None and hasattr(ops, "rope_cache")) else None  # type: ignore[assignment]
        self.heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim) if attn else (0, 0, 0)
        self.o_projs: list[Projection] = [layer.self_attn.o_proj.forward
                                          for layer in model.layers]

    @staticmethod
    def for_model(model: nn.Module, ops: LayerOps) -> LayerLoop | None:
        """The loop for `model`, or None where it is not built of the plain Llama classes."""
        # The embedding's lookup must be a tensor of its own: the loop sums into it in place.
        plain = (type(model) is LlamaModel and type(model.norm) is RMSNorm
                 and type(model.embed_tokens) in (nn.Embedding, Int8Embedding)) and all(
            type(layer) is DecoderLayer and type(layer.self_attn) is Attention
            and type(layer.mlp) is MLP and type(layer.input_layernorm) is RMSNorm
            and type(layer.post_attention_layernorm) is RMSNorm for layer in model.layers)
        return LayerLoop(model, ops) if plain else None

    def takes(self, x: torch.Tensor, meta: object) -> bool:
        return self.ops.takes_layer_loop(x, meta)

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            logits_indices: torch.Tensor) -> torch.Tensor:
        """x: the step's embedded rows [T, hidden], a tensor of its own (the residual stream is
        summed into it in place) -> logits [N, vocab] of the rows `logits_indices` names."""
        ops = self.ops
        heads, kv_heads, head_dim = self.heads
        fused = self.rope_cache
        if fused is not None and not (
                fused.takes_rope_cache(meta, x.shape[0], head_dim) and cos.is_contiguous()
                and sin.is_contiguous() and all(c.is_contiguous() for c in kv_caches[0])):
            fused = None
        delta = None  # the residual branch not yet added into x
        for (in_w, in_eps, qkv_proj, attend, post_w, post_eps, gate_up_proj,
             down_proj), o_proj, kv in zip(self.layers, self.o_projs, kv_caches):
            h = (ops.rms_norm(x, in_w, in_eps) if delta is None
                 else ops.add_rms_norm(x, delta, in_w, in_eps))
            if fused is not None:  # RoPE and the cache write in one call, then attention
                q = fused.rope_cache(qkv_proj(h), cos, sin, kv, meta.slot_mapping, heads,
                                     kv_heads, head_dim)
                a = o_proj(attend_written(q, kv, meta))
            else:
                a = attend(qkv_proj(h), cos, sin, meta, kv)
            h = ops.add_rms_norm(x, a, post_w, post_eps)
            delta = down_proj(ops.silu_mul(gate_up_proj(h)))
        w, eps = self.final_norm
        h = ops.rms_norm(x, w, eps) if delta is None else ops.add_rms_norm(x, delta, w, eps)
        # Per-row norms: normalising every row, then picking, is picking, then normalising.
        return self.lm_head(h.index_select(0, logits_indices)).float()
