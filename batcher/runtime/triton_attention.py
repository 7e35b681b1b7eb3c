"""Paged decode attention as a Triton kernel: reads K/V straight from the block table (no gather),
so a decode step's memory traffic is the context itself, and its shapes are fixed for CUDA graphs.

One program per (sequence, kv head): the group of query heads that share the kv head is scored
against each block in turn with an online softmax. Imported only where Triton is available."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    gmask = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None], other=0.0).to(tl.float32)  # [G, D]
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    den = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    num_blocks = (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE
    for b in range(num_blocks):
        blk = tl.load(tables_ptr + seq * stride_bt + b).to(tl.int64)
        smask = b * BLOCK_SIZE + s < ctx
        offs = blk * stride_kb + s[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        k = tl.load(k_ptr + offs, mask=smask[:, None], other=0.0).to(tl.float32)  # [S, D]
        v = tl.load(v_ptr + offs, mask=smask[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, S]
        scores = tl.where(smask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        den = den * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / den[:, None]
    tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim];
    block_tables: [B, max_blocks] int32; context_lens: [B] int32 (>= 1) -> [B, heads, head_dim]."""
    b, heads, hd = q.shape
    _, block_size, kvh, _ = k_cache.shape
    group = heads // kvh
    if out is None:
        out = torch.empty_like(q)
    _paged_decode_kernel[(b, kvh)](
        q, k_cache, v_cache, out, block_tables, context_lens, hd ** -0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(triton.next_power_of_2(group), 2), HEAD_DIM=hd,
        BLOCK_SIZE=block_size)
    return out
