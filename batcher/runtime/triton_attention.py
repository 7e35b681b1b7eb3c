"""Paged decode attention as Triton kernels (flash-decoding): K/V are read straight from the
block table (no gather), so a decode step's memory traffic is the context itself, and the launch
shapes depend on tensor shapes only (no host read of the lengths), so the calls capture in CUDA
graphs.

Grid (sequence, kv head, split): each program scores the whole GQA group of query heads that
share its kv head against its share of the sequence's context, tile by tile, with an online
softmax, so each K/V tile is read once per group. With one split the program writes the output;
with more it writes a partial (normalised output and log-sum-exp) and `_merge_splits_kernel`
combines the splits. The split count comes from the shapes (`choose_num_splits`); each
sequence's context is divided among the splits on the device, so short sequences in a wide
table leave the splits past their length idle rather than reading padding.
See docs/gpu-kernels.md. Imported only where Triton is available."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Split heuristics (not yet tuned by measurement; docs/gpu-kernels.md): aim for this many
# programs per multiprocessor, give a split at least this many tokens of the table's width, and
# never more than this many splits.
PROGRAMS_PER_SM = 2
MIN_SPLIT_TOKENS = 64
MAX_SPLITS = 64  # a power of two: the merge's padded width
# The multiprocessor count assumed where the tensors are not on a GPU (the interpreter): an
# H100/H200's, so CPU tests exercise the choices a GPU would make.
DEFAULT_SMS = 132


# The split count and the table's width vary from step to step: not specialised on, so they
# compile no new variants while a server runs.
@triton.jit(do_not_specialize=["stride_bt", "window", "num_splits"])
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, lse_ptr, tables_ptr, lens_ptr,
    scale, softcap, window, num_splits,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + seq)
    start = 0
    if HAS_WINDOW:  # keys j with ctx - window <= j < ctx; blocks before are never read
        start = tl.maximum(ctx - window, 0)
    # This split's tiles: the sequence's tiles [first, last) divided among the splits.
    first = start // TILE
    last = (ctx + TILE - 1) // TILE
    per_split = (last - first + num_splits - 1) // num_splits
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, last)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    t = tl.arange(0, TILE)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = kvh * GROUP + g
    # The matrix products' inputs: the cache's dtype, or fp32 (DOT_FP32).
    dot_ty = tl.float32 if DOT_FP32 else k_ptr.dtype.element_ty
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(dot_ty)  # [G, D]
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    den = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for tile in range(lo, hi):
        tok = tile * TILE + t  # [T] token positions
        tmask = (tok < ctx) & (tok >= start)
        # A tile spans several blocks or part of one: each token's block id.
        blk = tl.load(tables_ptr + seq * stride_bt + tok // BLOCK_SIZE, mask=tmask,
                      other=0).to(tl.int64)
        offs = (blk[:, None] * stride_kb + (tok % BLOCK_SIZE)[:, None] * stride_ks
                + kvh * stride_kh + d[None, :])  # [T, D]: contiguous over head_dim
        kvmask = tmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + offs, mask=kvmask, other=0.0).to(dot_ty)
        v = tl.load(v_ptr + offs, mask=kvmask, other=0.0).to(dot_ty)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G, T] fp32
        if HAS_SOFTCAP:  # softcap * tanh(scores / softcap), tanh through exp (no overflow)
            e = tl.exp(-2.0 * tl.abs(scores) / softcap)
            scores = tl.where(scores < 0, -softcap, softcap) * (1.0 - e) / (1.0 + e)
        scores = tl.where(tmask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        den = den * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_ty), v, input_precision=PRECISION)
        m = m_new
    if not SPLIT:
        out = acc / den[:, None]
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
    else:
        # Partials: part [B, heads, splits, head_dim] fp32, lse [B, heads, splits] fp32; a split
        # with no tiles (past a short sequence's end) leaves lse = -inf, weight 0 in the merge.
        nonempty = den > 0
        out = acc / tl.where(nonempty, den, 1.0)[:, None]
        lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, den, 1.0)), float("-inf"))
        row = (seq * GROUP * tl.num_programs(1) + heads) * num_splits + split  # [G]
        tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], out,
                 mask=gmask[:, None] & dmask[None, :])
        tl.store(lse_ptr + row, lse, mask=gmask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(out_ptr, part_ptr, lse_ptr, stride_ot, stride_oh, num_splits,
                         HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                         SPLITS_PAD: tl.constexpr):
    # One program per (sequence, query head): out = sum_s exp(lse_s - M) o_s / sum_s exp(...).
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    s = tl.arange(0, SPLITS_PAD)
    smask = s < num_splits
    d = tl.arange(0, DIM_PAD)
    dmask = d < HEAD_DIM
    # lse: [S]; a sequence has at least one non-empty split, so the max is finite.
    lse = tl.load(lse_ptr + row * num_splits + s, mask=smask, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))
    part = tl.load(part_ptr + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
                   mask=smask[:, None] & dmask[None, :], other=0.0)  # [S, D]
    out = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=dmask)


def choose_num_splits(batch: int, kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per sequence: enough programs (batch x kv_heads x splits) to give every
    multiprocessor PROGRAMS_PER_SM, no split shorter than MIN_SPLIT_TOKENS of `max_context` (the
    block table's width in tokens), at most MAX_SPLITS. 1 (no merge pass) where the batch alone
    fills the device or the context is short. Shapes only: no read of the lengths, so the
    choice is the same when a CUDA graph replays."""
    want = -(-PROGRAMS_PER_SM * num_sms // max(batch * kv_heads, 1))
    return max(1, min(want, max_context // MIN_SPLIT_TOKENS, MAX_SPLITS))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           out: torch.Tensor | None = None, *, scale: float | None = None,
                           window: int | None = None, softcap: float | None = None,
                           num_splits: int | None = None) -> torch.Tensor:
    """q: [B, heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim], same dtype
    as q (fp32, bf16 or fp16); block_tables: [B, max_blocks] int32; context_lens: [B] int32
    (>= 1) -> [B, heads, head_dim]. Optional: `scale` (default 1/sqrt(head_dim)), a sliding
    `window` (the last `window` keys, the query's own included), a tanh `softcap` on the scores,
    and `num_splits` (1 to MAX_SPLITS; default `choose_num_splits`)."""
    b, heads, hd = q.shape
    _, block_size, kvh, _ = k_cache.shape
    group = heads // kvh
    if out is None:
        out = torch.empty_like(q)
    if num_splits is None:
        num_splits = choose_num_splits(b, kvh, block_tables.shape[1] * block_size,
                                       _num_sms(q.device))
    assert 1 <= num_splits <= MAX_SPLITS, num_splits
    dim_pad = max(triton.next_power_of_2(hd), 16)
    # tl.dot wants every dimension >= 16: the group's rows are padded (masked) to 16. A tile is
    # independent of the block size (a token's block is looked up per token). Tile and warps
    # keep a program near 100 registers a thread when compiled for sm_90 (2-4 programs per
    # multiprocessor, 8-16 KiB of K/V in flight each); not yet tuned by timing.
    tile = 32 if dim_pad <= 128 else 16
    warps = 4 if dim_pad <= 64 else 8
    # Triton's interpreter (CPU tensors) multiplies bf16's raw bits in tl.dot: there the products
    # take fp32 inputs. On a GPU, half-precision caches feed the tensor cores as they are.
    dot_fp32 = k_cache.dtype == torch.float32 or q.device.type != "cuda"
    if num_splits > 1:
        part = torch.empty(b, heads, num_splits, hd, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # unused
    _paged_decode_kernel[(b, kvh, num_splits)](
        q, k_cache, v_cache, out, part, lse, block_tables, context_lens,
        hd ** -0.5 if scale is None else scale, 1.0 if softcap is None else softcap,
        0 if window is None else window, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(triton.next_power_of_2(group), 16), HEAD_DIM=hd,
        DIM_PAD=dim_pad, BLOCK_SIZE=block_size, TILE=tile, SPLIT=num_splits > 1,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        DOT_FP32=dot_fp32, PRECISION="ieee" if dot_fp32 else "tf32", num_warps=warps)
    if num_splits > 1:
        _merge_splits_kernel[(b, heads)](out, part, lse, out.stride(0), out.stride(1), num_splits,
                                         HEAD_DIM=hd, DIM_PAD=dim_pad, SPLITS_PAD=MAX_SPLITS,
                                         num_warps=4)
    return out


def self_check(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
               head_dim: int, block_size: int) -> str | None:
    """Run the kernel once on small synthetic decode rows in the model's shapes (one split and
    several) and compare it with plain torch attention: None when they agree, else why not. The
    runner calls this once before serving, so a device whose compiler refuses the kernel, or
    computes it wrongly, keeps the torch path instead of failing or corrupting every decode."""
    gen = torch.Generator().manual_seed(0)
    lens = [1, 37, 200]  # one key, a partial block, several splits' worth
    nblocks = [-(-n // block_size) for n in lens]
    kc = torch.randn(sum(nblocks), block_size, kv_heads, head_dim, generator=gen)
    vc = torch.randn(sum(nblocks), block_size, kv_heads, head_dim, generator=gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    tables = torch.zeros(len(lens), max(nblocks), dtype=torch.int32)
    want, first = [], 0
    for i, (n, nb) in enumerate(zip(lens, nblocks)):
        ids = list(range(first, first + nb))
        first += nb
        tables[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        keys = kc[ids].reshape(-1, kv_heads, head_dim)[:n].repeat_interleave(heads // kv_heads, 1)
        vals = vc[ids].reshape(-1, kv_heads, head_dim)[:n].repeat_interleave(heads // kv_heads, 1)
        want.append(torch.nn.functional.scaled_dot_product_attention(
            q[i][:, None], keys.transpose(0, 1), vals.transpose(0, 1))[:, 0])
    try:
        to = dict(device=device, dtype=dtype)
        errs = []
        for splits in (1, 4):
            got = paged_decode_attention(q.to(**to), kc.to(**to), vc.to(**to),
                                         tables.to(device), torch.tensor(lens, dtype=torch.int32,
                                                                         device=device),
                                         num_splits=splits)
            errs.append((got.float().cpu() - torch.stack(want)).abs().max().item())
    except Exception as exc:  # a compiler or driver that refuses the kernel
        return f"{type(exc).__name__}: {exc}"
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    err = max(errs)
    return None if err <= tol else f"differs from torch attention by {err:.3g} (> {tol})"
