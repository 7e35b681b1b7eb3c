"""Attention for layers that differ from Llama's (`AttentionVariant`: Gemma's soft-capped scores,
Mistral's and Phi-3's sliding windows, a scale other than 1/sqrt(head_dim)), on the torch path:
decode rows by their gathered groups, each prefill chunk over its gathered context, masked to the
window. The fused kernels take plain layers only (`batcher.runtime.attention`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batcher.runtime.attention import AttentionMetadata, write_kv


@dataclass(slots=True, frozen=True)
class AttentionVariant:
    """What a layer's attention does beyond Llama's (Gemma, Mistral, Phi-3 windows): a sliding
    `window` (keys a query sees, its own included: key j for query i when i - window < j <= i),
    a `scale` other than 1/sqrt(head_dim), and a tanh `softcap` on the scores. Those layers run
    `variant_attention`, the torch path; the fused decode kernels take plain layers only."""

    window: int | None = None
    scale: float | None = None
    softcap: float | None = None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            spec: AttentionVariant) -> torch.Tensor:
    # q: [B, heads, n, head_dim]; k, v: [B, kv_heads, ctx, head_dim]; mask: bool, broadcast to
    # [B, heads, n, ctx] (True = attend) -> [B, heads, n, head_dim]
    heads, kvh = q.shape[1], k.shape[1]
    if spec.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.scale,
                                              enable_gqa=heads != kvh)
    if heads != kvh:
        k = k.repeat_interleave(heads // kvh, dim=1)
        v = v.repeat_interleave(heads // kvh, dim=1)
    scale = spec.scale if spec.scale is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, heads, n, ctx]
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _window_mask(q_pos: torch.Tensor, ctx: int, window: int | None) -> torch.Tensor:
    # q_pos: [rows] -> [rows, ctx] bool: causal, and within the window when there is one.
    keys = torch.arange(ctx, device=q_pos.device).unsqueeze(0)
    q = q_pos.unsqueeze(1)
    mask = keys <= q
    return mask if window is None else mask & (keys > q - window)


def variant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                      spec: AttentionVariant) -> torch.Tensor:
    """`paged_attention` for layers with an `AttentionVariant`, on the torch path: decode rows
    by their gathered groups, each prefill chunk over its gathered context, masked to the
    window. Blocks wholly behind a window are never read, so the cache may have freed them."""
    write_kv(k, v, kv_cache, meta.slot_mapping)
    assert meta.fused is None and meta.decode_tables is None, "variant layers run the torch path"
    t, heads, hd = q.shape
    k_cache, v_cache = kv_cache
    kvh = k_cache.shape[2]
    bs = meta.block_size
    out = q.new_empty(t, heads * hd)
    row = 0
    for g in meta.decode_groups:
        rows = g.rows
        ctx = g.max_blocks * bs
        mask = g.mask  # [rows, 1, 1, ctx]: keys before each row's length
        if spec.window is not None:
            lens = mask.sum(-1, keepdim=True)  # [rows, 1, 1, 1]
            mask = mask & (torch.arange(ctx, device=q.device) >= lens - spec.window)
        kb = k_cache.index_select(0, g.table).view(rows, ctx, kvh, hd).transpose(1, 2)
        vb = v_cache.index_select(0, g.table).view(rows, ctx, kvh, hd).transpose(1, 2)
        if meta.fold_gqa and spec.softcap is None:
            # One query token per row: each KV head's query heads as its query length (the
            # CPU's fast path in reduced precision, as `_attend_blocks` does).
            qh = q[row:row + rows].view(rows, kvh, heads // kvh, hd)
        else:
            qh = q[row:row + rows].unsqueeze(2)  # [rows, heads, 1, head_dim]
        out[row:row + rows] = _attend(qh, kb, vb, mask, spec).reshape(rows, heads * hd)
        row += rows
    for chunk in meta.prefills:
        n, ctx = chunk.length, chunk.context_len
        rows = slice(chunk.row, chunk.row + n)
        if chunk.start_pos == 0:
            kh, vh = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [kv_heads, n, hd]
        else:
            kh = k_cache.index_select(0, chunk.block_ids).view(-1, kvh, hd)[:ctx].transpose(0, 1)
            vh = v_cache.index_select(0, chunk.block_ids).view(-1, kvh, hd)[:ctx].transpose(0, 1)
        q_pos = torch.arange(chunk.start_pos, ctx, device=q.device)
        mask = _window_mask(q_pos, ctx, spec.window)  # [n, ctx]
        qh = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
        o = _attend(qh, kh.unsqueeze(0), vh.unsqueeze(0), mask, spec)
        out[rows] = o[0].transpose(0, 1).reshape(n, heads * hd)
    return out
