"""Paged varlen prefill attention as one Triton kernel: every prompt chunk of a step (a mixed
step's prefill rows included) in one launch, no per-sequence loop, no gather.

Grid (query tile, query head): the host lays each chunk's rows out in tiles of BLOCK_M and
lists them all (`VarlenPrefill`), so programs never straddle two sequences and no program is
launched for padding. A program loads its tile of queries and walks its sequence's keys with an
online softmax (flash-attention): first the cached prefix, read in place through the block table
(every prefix key precedes every query, so no causal mask), then the chunk's own new keys from
the step's K/V rows (causal within the chunk), up to the tile's last query. GQA: the program's
kv head is its query head // group. Scores, softmax and the accumulator are fp32; the matrix
products take the cache's dtype (fp32 as IEEE, so fp32 results match the torch path tightly).
Imported only where Triton is available (`attention.paged_attention` dispatches here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import triton
import triton.language as tl


class Chunk(Protocol):
    """What the kernel reads of a prompt chunk (`attention.PrefillChunk` is one): its first row
    in the step, its length, its first position, and the blocks holding its context."""

    row: int
    length: int
    start_pos: int
    block_ids: torch.Tensor


@dataclass(slots=True)
class _SyntheticChunk:  # the self-check's chunks
    row: int
    length: int
    start_pos: int
    block_ids: torch.Tensor


# Query rows per program: chunks shorter than this get a smaller power of two (>= 16, tl.dot's
# minimum), so a mixed step's few-token chunks do not compute mostly padding. Keys per inner
# tile. Not yet tuned by measurement (docs/gpu-kernels.md).
MAX_BLOCK_M = 64
BLOCK_N = 64
_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _online_update(q, k, v, valid, m_i, l_i, acc, scale, softcap, HAS_SOFTCAP: tl.constexpr,
                   PRECISION: tl.constexpr, DOT: tl.constexpr):
    # q: [M, D]; k, v: [N, D]; valid: [M, N] -> the running max, denominator and output.
    s = tl.dot(q.to(DOT), tl.trans(k.to(DOT)), input_precision=PRECISION) * scale  # [M, N]
    if HAS_SOFTCAP:  # softcap * tanh(s / softcap), tanh through exp
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with no valid key yet keeps m = -inf: subtract 0 instead, so exp gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(DOT), v.to(DOT),
                                        input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["window", "num_seqs", "stride_bt"])
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, out_ptr, tables_ptr, seq_ptr, tile_ptr,
    scale, softcap, window, num_seqs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, OWN_IN_CACHE: tl.constexpr,
    PRECISION: tl.constexpr, DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    # seq_ptr: [3, num_seqs] (first row, length, cached prefix); tile_ptr: [2, tiles]
    # (sequence, first row within the chunk).
    seq = tl.load(tile_ptr + tile)
    m0 = tl.load(tile_ptr + tl.num_programs(0) + tile)
    row0 = tl.load(seq_ptr + seq)
    n = tl.load(seq_ptr + num_seqs + seq)
    prefix = tl.load(seq_ptr + 2 * num_seqs + seq)

    m = m0 + tl.arange(0, BLOCK_M)  # [M] query rows within the chunk
    d = tl.arange(0, DIM_PAD)
    mmask = m < n
    dmask = d < HEAD_DIM
    rows = (row0 + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0).to(kc_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    j = tl.arange(0, BLOCK_N)

    # 1. The cached prefix, keys [lo, prefix), in place through the block table.
    lo = 0
    if HAS_WINDOW:  # query i sees keys j with i - window < j: the tile's first query bounds it
        lo = tl.maximum(prefix + m0 - window + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, prefix, BLOCK_N):
        tok = start + j  # [N] key positions
        tmask = tok < prefix
        blk = tl.load(tables_ptr + seq * stride_bt + tok // BLOCK_SIZE, mask=tmask,
                      other=0).to(tl.int64)
        offs = (blk[:, None] * stride_cb + (tok % BLOCK_SIZE)[:, None] * stride_cs
                + kvh * stride_ch + d[None, :])  # [N, D]
        kvmask = tmask[:, None] & dmask[None, :]
        k = tl.load(kc_ptr + offs, mask=kvmask, other=0.0)
        v = tl.load(vc_ptr + offs, mask=kvmask, other=0.0)
        valid = tmask[None, :]
        if HAS_WINDOW:
            valid = valid & (tok[None, :] > (prefix + m)[:, None] - window)
        m_i, l_i, acc = _online_update(q, k, v, valid, m_i, l_i, acc, scale, softcap,
                                       HAS_SOFTCAP, PRECISION, DOT)

    # 2. The chunk's own keys, causal: keys [lo, the tile's end). From the step's K/V rows, or
    # (OWN_IN_CACHE: already written there) from the cache through the block table.
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(m0 - window + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, tl.minimum(m0 + BLOCK_M, n), BLOCK_N):
        c = start + j  # [N] key rows within the chunk
        cmask = c < n
        kvmask = cmask[:, None] & dmask[None, :]
        if OWN_IN_CACHE:
            tok = prefix + c
            blk = tl.load(tables_ptr + seq * stride_bt + tok // BLOCK_SIZE, mask=cmask,
                          other=0).to(tl.int64)
            offs = (blk[:, None] * stride_cb + (tok % BLOCK_SIZE)[:, None] * stride_cs
                    + kvh * stride_ch + d[None, :])
            k = tl.load(kc_ptr + offs, mask=kvmask, other=0.0)
            v = tl.load(vc_ptr + offs, mask=kvmask, other=0.0)
        else:
            krows = (row0 + c).to(tl.int64)
            k = tl.load(k_ptr + krows[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                        mask=kvmask, other=0.0)
            v = tl.load(v_ptr + krows[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                        mask=kvmask, other=0.0)
        valid = cmask[None, :] & (c[None, :] <= m[:, None])
        if HAS_WINDOW:
            valid = valid & (c[None, :] > m[:, None] - window)
        m_i, l_i, acc = _online_update(q, k, v, valid, m_i, l_i, acc, scale, softcap,
                                       HAS_SOFTCAP, PRECISION, DOT)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows (m >= n) are not stored
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def tiles_of(lengths: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """The kernel's query tiles for chunks of `lengths`: (chunk, first row within the chunk)
    per tile, `block_m` rows each, never two chunks in one tile."""
    seq: list[int] = []
    first: list[int] = []
    for i, n in enumerate(lengths):
        starts = range(0, n, block_m)
        seq.extend([i] * len(starts))
        first.extend(starts)
    return seq, first


@dataclass(slots=True)
class VarlenPrefill:
    """A step's prefill chunks as the kernel takes them, built once per step (first layer) and
    shared by every layer: two host-to-device copies (the index arrays, the block tables)."""

    tables: torch.Tensor  # [chunks, max_blocks] int32: each chunk's blocks, zero-padded
    seqs: torch.Tensor  # [3, chunks] int32: first row in the step, length, cached prefix
    tiles: torch.Tensor  # [2, tiles] int32: chunk, first row within the chunk
    block_m: int

    @classmethod
    def build(cls, chunks: list[Chunk], device: torch.device) -> VarlenPrefill:
        longest = max(c.length for c in chunks)
        block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(longest)))
        tile_seq, tile_row = tiles_of([c.length for c in chunks], block_m)
        idx = torch.tensor([c.row for c in chunks] + [c.length for c in chunks]
                           + [c.start_pos for c in chunks] + tile_seq + tile_row,
                           dtype=torch.int32).to(device, non_blocking=True)
        ns = len(chunks)
        tables = torch.nn.utils.rnn.pad_sequence([c.block_ids for c in chunks],
                                                 batch_first=True).to(torch.int32)
        return cls(tables, idx[:3 * ns].view(3, ns), idx[3 * ns:].view(2, -1), block_m)


def paged_prefill_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, batch: VarlenPrefill,
                            out: torch.Tensor, *, scale: float | None = None,
                            window: int | None = None, softcap: float | None = None
                            ) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim], the step's new K/V (rows as in
    q), or both None where the step's K/V are already in the cache (then every key is read
    through the block tables); caches: [num_blocks, block_size, kv_heads, head_dim], same dtype
    as q (fp32, bf16 or fp16), holding each chunk's cached prefix; out: [T, heads * head_dim]
    (or [T, heads, head_dim]). Writes the rows of `batch`'s chunks into `out` (other rows are
    left alone) and returns it. Optional: `scale` (default 1/sqrt(head_dim)), a sliding `window`
    (query i sees keys j with i - window < j <= i) and a tanh `softcap` on the scores."""
    t, heads, hd = q.shape
    _, block_size, kvh, _ = k_cache.shape
    own_in_cache = k is None
    if own_in_cache:
        assert v is None
        k = v = q  # unread: the kernel's pointers need a tensor
    assert heads % kvh == 0 and v_cache.stride() == k_cache.stride()
    assert own_in_cache or k.shape[1] == kvh
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == k_cache.stride(-1) == 1
    o = out.view(t, heads, hd)
    tiles = batch.tiles.shape[1]
    dim_pad = max(triton.next_power_of_2(hd), 16)
    # NOTE: Triton 3.9's interpreter (CPU tensors) multiplies bf16 tiles wrongly: there the
    # products take fp32 inputs (the values rounded to bf16 first, so results stay close).
    interpreted = q.device.type == "cpu"
    dot = tl.float32 if interpreted and k_cache.dtype == torch.bfloat16 else _DTYPES[q.dtype]
    _paged_prefill_kernel[(tiles, heads)](
        q, k, v, k_cache, v_cache, o, batch.tables, batch.seqs, batch.tiles,
        hd ** -0.5 if scale is None else scale, 1.0 if softcap is None else softcap,
        0 if window is None else window, batch.seqs.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), o.stride(0), o.stride(1),
        batch.tables.stride(0),
        GROUP=heads // kvh, HEAD_DIM=hd, DIM_PAD=dim_pad, BLOCK_SIZE=block_size,
        BLOCK_M=batch.block_m, BLOCK_N=BLOCK_N if dim_pad <= 128 else BLOCK_N // 2,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        OWN_IN_CACHE=own_in_cache, PRECISION="ieee" if dot == tl.float32 else "tf32", DOT=dot)
    return out


def self_check(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
               head_dim: int, block_size: int) -> str | None:
    """Run the kernel on small synthetic steps in the model's shapes, one for each query tile
    size a step can take (16, 32 and 64 rows, each compiled on its own), and compare it with
    plain torch attention: None when they agree, else why not. A device whose compiler rejects
    the kernel, or computes it wrongly, then keeps the torch path (the runner calls this once,
    before serving) instead of failing requests or answering with wrong tokens."""
    # (chunk length, cached prefix): a first chunk, one after a cached prefix, a long one;
    # each with the chunks' own keys from the step's rows and from the cache.
    steps = ([(5, 0)], [(5, 0), (19, 21)], [(5, 0), (19, 21), (70, 3)])
    for step in steps:
        for own_in_cache in (False, True):
            why = _check_step(step, device, dtype, heads, kv_heads, head_dim, block_size,
                              own_in_cache)
            if why is not None:
                return why + (" (own keys from the cache)" if own_in_cache else "")
    return None


def _check_step(step: list[tuple[int, int]], device: torch.device, dtype: torch.dtype,
                heads: int, kv_heads: int, head_dim: int, block_size: int,
                own_in_cache: bool = False) -> str | None:
    gen = torch.Generator().manual_seed(len(step))
    blocks = [-(-(n + p) // block_size) for n, p in step]
    kc = torch.randn(sum(blocks), block_size, kv_heads, head_dim, generator=gen)
    vc = torch.randn(sum(blocks), block_size, kv_heads, head_dim, generator=gen)
    t = sum(n for n, _ in step)
    q, k, v = (torch.randn(t, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    chunks: list[Chunk] = []
    want, row, first = [], 0, 0
    group = heads // kv_heads
    for (n, p), nb in zip(step, blocks):
        ids = list(range(first, first + nb))
        first += nb
        # The chunk's own K/V in its slots, as write_kv would have put them.
        slots = torch.tensor([ids[i // block_size] * block_size + i % block_size
                              for i in range(p, p + n)])
        kc.view(-1, kv_heads, head_dim)[slots] = k[row:row + n]
        vc.view(-1, kv_heads, head_dim)[slots] = v[row:row + n]
        keys = kc[ids].reshape(-1, kv_heads, head_dim)[:p + n].repeat_interleave(group, 1)
        vals = vc[ids].reshape(-1, kv_heads, head_dim)[:p + n].repeat_interleave(group, 1)
        mask = torch.arange(p + n) <= torch.arange(p, p + n)[:, None]
        want.append(torch.nn.functional.scaled_dot_product_attention(
            q[row:row + n].transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
            attn_mask=mask).transpose(0, 1))
        chunks.append(_SyntheticChunk(row, n, p, torch.tensor(ids, device=device)))
        row += n
    want_out = torch.cat(want).reshape(t, -1)
    try:
        to = dict(device=device, dtype=dtype)
        out = torch.zeros(t, heads * head_dim, **to)
        kv = (None, None) if own_in_cache else (k.to(**to), v.to(**to))
        got = paged_prefill_attention(q.to(**to), *kv, kc.to(**to), vc.to(**to),
                                      VarlenPrefill.build(chunks, device), out)
        err = (got.float().cpu() - want_out).abs().max().item()
    except Exception as exc:  # a compiler or driver that refuses the kernel
        return f"{type(exc).__name__}: {exc}"
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    return None if err <= tol else f"differs from torch attention by {err:.3g} (> {tol})"
