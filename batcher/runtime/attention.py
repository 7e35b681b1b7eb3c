"""Paged attention, torch reference path (CPU and CUDA).

One call per layer covers the whole flattened batch: decode rows (one query token each) first, in one
batched SDPA over their gathered blocks; then prefill chunks, one SDPA per sequence (causal, aligned
to the bottom right when a chunk continues an earlier one). Everything that does not depend on the
layer (block tables, masks, slot mapping, the gather workspace) is built once per step in
`AttentionMetadata`; a fused kernel can take the same metadata later. On the triton backend
(CUDA) decode rows run `triton_attention` and all prefill chunks one `triton_prefill` launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from batcher.runtime.prefill_staging import StagedKV
from batcher.runtime.token_ops import apply_rope

if TYPE_CHECKING:
    from batcher.runtime.triton_prefill import VarlenPrefill


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's multi-token chunk: query rows [row, row + length) at positions
    [start_pos, start_pos + length), attending to its first `start_pos + length` cached tokens."""

    row: int
    length: int
    start_pos: int
    block_ids: torch.Tensor  # [blocks covering start_pos + length], long
    mask: torch.Tensor | None  # [length, context] bool (True = attend); None = plain causal
    # `mask` with each row repeated per query head of a KV head, built by the first layer.
    fold_mask: torch.Tensor | None = None
    # The sequence's contiguous K/V while its prompt is read in chunks (`prefill_staging`):
    # the chunk appends to it and attends over it in place, instead of gathering its context.
    stage: StagedKV | None = None

    @property
    def context_len(self) -> int:
        return self.start_pos + self.length


@dataclass(slots=True)
class DecodeGroup:
    """Consecutive decode rows padded to one context length: `table` holds each row's first
    `max_blocks` block ids (flattened), `mask` hides the padding."""

    rows: int
    max_blocks: int
    table: torch.Tensor  # [rows * max_blocks] long
    mask: torch.Tensor  # [rows, 1, 1, max_blocks * block_size] bool


class FusedAttention(Protocol):
    """A kernel that runs a decode-only step's attention from the QKV projection on
    (`batcher.runtime.fused_decode.FusedDecode`)."""

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kv_cache: tuple[torch.Tensor, torch.Tensor], step: FusedDecodeStep,
               heads: int, kv_heads: int, head_dim: int) -> torch.Tensor: ...

    def attend_rotated(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                       step: FusedDecodeStep) -> torch.Tensor: ...


@dataclass(slots=True)
class FusedDecodeStep:
    """A decode-only step's inputs to a `FusedAttention` kernel, shared by every layer."""

    kernels: FusedAttention
    block_size: int
    slots: torch.Tensor  # [rows] int64: where each row's new K/V go
    tables: torch.Tensor  # [rows, max_blocks] int32
    lens: torch.Tensor  # [rows] int32: tokens each row attends to, its new one included


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention inputs shared by every layer."""

    block_size: int
    slot_mapping: torch.Tensor  # [T] long: cache slot (block * block_size + offset) per new token
    num_decodes: int = 0  # rows [0, num_decodes) are single-token queries, one per sequence
    # Decode rows sorted by context, longest first, in groups of similar length, so short
    # contexts are not padded to the longest one.
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Fused path (CUDA + Triton): a kernel reads blocks in place, no gather; set both or neither.
    decode_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int32
    decode_lens: torch.Tensor | None = None  # [num_decodes] int32
    # Prefill chunks in one varlen Triton launch (`triton_prefill`): None follows the decode
    # switch (`decode_tables` set, on CUDA), so a mixed step takes it; a prefill-only step has
    # no decode tables, so the triton backend's runner must set True there.
    triton_prefill: bool | None = None
    # The kernel's chunk layout: built from `prefills` by the first layer, or given (a captured
    # step of `mixed_graphs`). Given, `num_decodes` counts the decode kernel's padded rows,
    # which may run past the step's decode rows: the kernel's chunks then overwrite those rows.
    varlen: VarlenPrefill | None = None
    # Fold GQA into the query length for decode rows: one-token `enable_gqa` SDPA takes a much
    # slower kernel path on CPU in bf16; in fp32 `enable_gqa` is as fast or faster.
    fold_gqa: bool = True
    # CPU, bf16: the fused kernel's inputs for the decode rows (`fused_decode`), in place of
    # `decode_groups`. A decode-only step then skips the torch path altogether.
    fused: FusedDecodeStep | None = None
    # Gather buffers reused by every layer of the step (allocated once per step, lazily).
    _workspace: dict[str, torch.Tensor] = field(default_factory=dict)

    def gather_buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        buf = self._workspace.get(name)
        if buf is None or buf.shape != shape or buf.dtype != like.dtype:
            buf = torch.empty(shape, dtype=like.dtype, device=like.device)
            self._workspace[name] = buf
        return buf


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
             slot_mapping: torch.Tensor) -> None:
    # k, v: [T, kv_heads, head_dim] -> cache [num_blocks, block_size, kv_heads, head_dim] by slot
    k_cache, v_cache = kv_cache
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)


def rotate_and_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        kv_cache: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor,
                        heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """From a fused QKV projection's rows [T, (heads + 2 * kv_heads) * head_dim] in torch's ops:
    RoPE on Q and K, K and V written at `slots` -> Q rotated [T, heads, head_dim]. What the fused
    kernels that do this in one call (the CPU's decode attention, the GPU's `rope_cache`) are
    checked against."""
    rows = qkv.shape[0]
    qk_end = (heads + kv_heads) * head_dim
    qk = apply_rope(qkv[:, :qk_end].reshape(rows, heads + kv_heads, head_dim), cos, sin)
    q, k = qk.split([heads, kv_heads], dim=1)
    write_kv(k, qkv[:, qk_end:].reshape(rows, kv_heads, head_dim), kv_cache, slots)
    return q


def decode_attention(q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                     meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
    """The decode rows' attention, their new K/V already in the cache: q [D, heads, head_dim]
    (RoPE applied) -> [D, heads * head_dim], written into `out` where given (the Triton kernel
    writes it in place; the other paths copy)."""
    k_cache, v_cache = kv_cache
    d_rows, heads, hd = q.shape
    if meta.decode_tables is not None and meta.fused is None:
        from batcher.runtime.triton_attention import paged_decode_attention

        return paged_decode_attention(
            q, k_cache, v_cache, meta.decode_tables, meta.decode_lens,
            out=None if out is None else out.view(d_rows, heads, hd)).view(d_rows, heads * hd)
    if out is not None:
        out.copy_(decode_attention(q, kv_cache, meta))
        return out
    if meta.fused is not None:  # the CPU kernel, reading the blocks in place
        return meta.fused.kernels.attend_rotated(q, kv_cache, meta.fused)
    groups = meta.decode_groups
    if len(groups) == 1:
        return _decode_group(q, kv_cache, meta, groups[0], 0)
    out = q.new_empty(d_rows, heads * hd)
    row = 0
    for i, g in enumerate(groups):
        out[row:row + g.rows] = _decode_group(q[row:row + g.rows], kv_cache, meta, g, i)
        row += g.rows
    return out


def _decode_group(q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                  meta: AttentionMetadata, g: DecodeGroup, idx: int) -> torch.Tensor:
    k_cache, v_cache = kv_cache
    shape = (g.table.shape[0], meta.block_size, *k_cache.shape[2:])
    # One index_select per K and V into a reused buffer: 3x faster than cache[table].
    return _attend_blocks(q, kv_cache, g.table, g.mask, meta.block_size, meta.fold_gqa,
                          meta.gather_buffer(f"k{idx}", shape, k_cache),
                          meta.gather_buffer(f"v{idx}", shape, v_cache))


def _attend_blocks(q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                   table: torch.Tensor, mask: torch.Tensor, block_size: int, fold_gqa: bool,
                   k_out: torch.Tensor | None = None, v_out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    # q: [rows, heads, head_dim]; table: [rows * max_blocks] -> [rows, heads * head_dim]
    k_cache, v_cache = kv_cache
    rows, heads, hd = q.shape
    kvh = k_cache.shape[2]
    ctx = table.shape[0] // rows * block_size
    kb = torch.index_select(k_cache, 0, table, out=k_out)
    vb = torch.index_select(v_cache, 0, table, out=v_out)
    k = kb.view(rows, ctx, kvh, hd).transpose(1, 2)  # [rows, kv_heads, ctx, head_dim]
    v = vb.view(rows, ctx, kvh, hd).transpose(1, 2)
    if fold_gqa:
        qg = q.view(rows, kvh, heads // kvh, hd)  # [rows, kv_heads, group, head_dim]
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    else:
        qh = q.unsqueeze(2)  # [rows, heads, 1, head_dim]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask,
                                             enable_gqa=heads != kvh)
    return out.reshape(rows, heads * hd)


@dataclass(slots=True)
class OneGroupDecode:
    """A decode-only step whose rows share one context group, held in tensors alone: what a
    compiled forward takes in place of `AttentionMetadata` (`batcher.runtime.compiled_decode`),
    so that its graph holds no Python lists or per-step integers."""

    block_size: int
    fold_gqa: bool
    slot_mapping: torch.Tensor  # [rows] long
    table: torch.Tensor  # [rows * max_blocks] long
    mask: torch.Tensor  # [rows, 1, 1, max_blocks * block_size] bool


def _prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                       kv_cache: tuple[torch.Tensor, torch.Tensor],
                       chunk: PrefillChunk, block_size: int,
                       fold_gqa: bool = False) -> torch.Tensor:
    # q: [n, heads, head_dim]; k_new, v_new: [n, kv_heads, head_dim] -> [n, heads * head_dim]
    n, heads, hd = q.shape
    kvh = k_new.shape[1]
    staged = None
    if chunk.stage is not None:
        staged = chunk.stage.context(kv_cache, k_new, v_new, chunk.start_pos, chunk.block_ids)
    if chunk.start_pos == 0:
        # A first chunk attends only to itself: use the fresh K/V, no gather.
        kh = k_new.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, n, head_dim]
        vh = v_new.transpose(0, 1).unsqueeze(0)
    elif staged is not None:
        kh, vh = staged  # [1, kv_heads, ctx, head_dim], read in place
    else:
        k_cache, v_cache = kv_cache
        ctx = chunk.context_len
        k = k_cache.index_select(0, chunk.block_ids).view(-1, kvh, hd)[:ctx]
        v = v_cache.index_select(0, chunk.block_ids).view(-1, kvh, hd)[:ctx]
        kh = k.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx, head_dim]
        vh = v.transpose(0, 1).unsqueeze(0)
    if fold_gqa and chunk.mask is not None and heads != kvh and q.device.type == "cpu":
        # A continued chunk is a few queries over a long context: with `enable_gqa`, SDPA on CPU
        # in reduced precision pays a per-call cost that grows with the context. Folding each KV
        # head's query heads into the query length is the same computation, about 2x faster for
        # chunks of up to 8 tokens at 2k context and no slower for long ones (measured on CPU
        # only, so CUDA keeps its kernels' own GQA path).
        group = heads // kvh
        if chunk.fold_mask is None:
            chunk.fold_mask = chunk.mask.repeat_interleave(group, dim=0)  # [n * group, ctx]
        qf = q.view(n, kvh, group, hd).transpose(0, 1).reshape(1, kvh, n * group, hd)
        out = F.scaled_dot_product_attention(qf, kh, vh, attn_mask=chunk.fold_mask)
        return out.view(kvh, n, group, hd).transpose(0, 1).reshape(n, heads * hd)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
    if chunk.mask is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True,
                                             enable_gqa=heads != kvh)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=chunk.mask,
                                             enable_gqa=heads != kvh)
    return out[0].transpose(0, 1).reshape(n, heads * hd)


def _prefill_in_kernel(meta: AttentionMetadata, q: torch.Tensor) -> bool:
    # The kernel does everything this path does for a plain layer (variant layers run
    # `variant_attention`) except reading a CPU prompt's staged K/V; the CPU keeps this path.
    # `q`: any tensor on the step's device.
    if meta.varlen is not None:
        return True
    on = meta.triton_prefill
    if on is None:
        on = meta.decode_tables is not None and q.device.type == "cuda"
    return on and bool(meta.prefills) and all(c.stage is None for c in meta.prefills)


def reads_cache_only(meta: AttentionMetadata, rows: int) -> bool:
    """Whether a step of `rows` rows can attend with every row's K/V already in the cache (so
    RoPE and the cache write may run first, as one kernel: `attend_written` without K/V): its
    decode rows through the Triton decode kernel, its prompt chunks through the varlen one."""
    nd = meta.num_decodes
    if meta.fused is not None or (nd and meta.decode_tables is None):
        return False
    return (nd == rows and meta.varlen is None) or _prefill_in_kernel(meta, meta.slot_mapping)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, torch.Tensor],
                    meta: AttentionMetadata | OneGroupDecode) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] (RoPE applied) -> [T, heads*dim].

    Writes the new K/V into the cache first, so every query sees its own token."""
    write_kv(k, v, kv_cache, meta.slot_mapping)
    if isinstance(meta, OneGroupDecode):
        return _attend_blocks(q, kv_cache, meta.table, meta.mask, meta.block_size, meta.fold_gqa)
    return attend_written(q, kv_cache, meta, k, v)


def attend_written(q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                   meta: AttentionMetadata, k: torch.Tensor | None = None,
                   v: torch.Tensor | None = None) -> torch.Tensor:
    """The step's attention, its new K/V already in the cache: q [T, heads, head_dim] (RoPE
    applied) -> [T, heads * head_dim]. `k`, `v`: the step's K/V rows, which prompt chunks on
    the torch path read; without them (where `reads_cache_only`) the varlen kernel reads the
    chunks' own keys from the cache."""
    t, heads, hd = q.shape
    if meta.num_decodes == t and meta.varlen is None:
        return decode_attention(q, kv_cache, meta)
    out = q.new_empty(t, heads * hd)
    nd = meta.num_decodes
    if nd:  # a captured step's padded decode rows may run over chunk rows, written below
        decode_attention(q[:nd], kv_cache, meta, out=out[:nd])
    if k is None or _prefill_in_kernel(meta, q):
        from batcher.runtime.triton_prefill import VarlenPrefill, paged_prefill_attention

        if meta.varlen is None:
            meta.varlen = VarlenPrefill.build(meta.prefills, q.device)
        return paged_prefill_attention(q, k, v, *kv_cache, meta.varlen, out)
    assert v is not None
    for chunk in meta.prefills:
        rows = slice(chunk.row, chunk.row + chunk.length)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], kv_cache, chunk,
                                       meta.block_size, meta.fold_gqa)
    return out
