"""Flash-decoding (`batcher.runtime.triton_attention`): the split kernel and its merge against a
float32 torch reference over random block tables, for GQA ratios 1-8, forced split counts
(including more splits than a sequence has tiles), head dims 64-256, fp32/bf16/fp16, windows,
soft-capping and strided queries; and the split-count chooser. Runs where
tests/test_triton_attention.py runs (its machinery: GPU, or the interpreter on the CPU)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.test_triton_attention import (
    DEVICE,
    assert_self_check_names_faults,
    compiled_already,
    kernel_module,
    run_interpreted,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")


def test_interpreted_in_a_fresh_process() -> None:
    if not compiled_already():
        pytest.skip("the interpreted tests run in this process")
    run_interpreted(__file__)


@pytest.fixture(scope="module")
def mod():
    with kernel_module() as m:
        yield m


def reference(q, k_cache, v_cache, tables, lens, scale=None, window=None, softcap=None):
    # q: [B, heads, D]; caches: [num_blocks, block_size, kv_heads, D] -> [B, heads, D] fp32
    b, heads, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(b, heads, d)
    for i in range(b):
        n = int(lens[i])
        first = 0 if window is None else max(0, n - window)
        blocks = tables[i, first // bs: -(-n // bs)].long().cpu()
        keys = slice(first % bs, first % bs + n - first)
        k = k_cache.cpu()[blocks].reshape(-1, kvh, d)[keys].float()  # [n, kv_heads, D]
        v = v_cache.cpu()[blocks].reshape(-1, kvh, d)[keys].float()
        k, v = (x.repeat_interleave(heads // kvh, 1) for x in (k, v))
        s = torch.einsum("hd,nhd->hn", q[i].float().cpu(), k) * (scale or d ** -0.5)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


def case(heads, kv_heads, lens, d=64, bs=16, dtype=torch.float32, seed=0, pad=None):
    """Random caches and tables: each row's blocks a random draw from the pool; the entries past
    a row's length are `pad` (default: out of range, so a read of one would fail)."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // bs)
    pool = 3 * width + 2
    kc = torch.randn(pool, bs, kv_heads, d, generator=gen).to(dtype)
    vc = torch.randn(pool, bs, kv_heads, d, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, d, generator=gen).to(dtype)
    tables = torch.full((len(lens), width), pool + 1000 if pad is None else pad,
                        dtype=torch.int32)
    for i, n in enumerate(lens):
        used = -(-n // bs)
        tables[i, :used] = torch.randperm(pool, generator=gen)[:used].int()
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, kc, vc, tables, lens_t)]


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def check(mod, args, dtype=torch.float32, **kw):
    out = mod.paged_decode_attention(*args, **kw)
    kw.pop("num_splits", None)
    assert out.dtype == dtype and out.shape == args[0].shape
    tol = TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), reference(*args, **kw), atol=tol, rtol=tol)


# Lengths: one token, not multiples of the block size, longer than a split.
LENS = [1, 23, 130]


@pytest.mark.parametrize("ratio,splits", [(1, 1), (2, 2), (4, 3), (8, 8), (8, 1), (2, 13)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_and_splits_match_reference(mod, ratio, splits, dtype):
    check(mod, case(2 * ratio, 2, LENS, dtype=dtype, seed=ratio), dtype, num_splits=splits)


@pytest.mark.parametrize("d,bs", [(96, 8), (128, 32), (256, 16), (64, 64)])
def test_head_dims_and_block_sizes(mod, d, bs):
    # Tiles of 16 or 32 tokens: several small blocks to a tile, or part of a large one.
    check(mod, case(4, 2, [5, 77], d=d, bs=bs, seed=d), num_splits=2)


def test_fp16(mod):
    check(mod, case(6, 2, [9, 100], dtype=torch.float16), torch.float16, num_splits=4)


@pytest.mark.parametrize("window,softcap,scale", [(40, None, None), (None, 5.0, 0.1),
                                                   (17, 2.0, None)])
def test_window_softcap_scale(mod, window, softcap, scale):
    # The blocks wholly before the window are out of range (freed): never read.
    q, kc, vc, tables, lens = case(4, 2, LENS, seed=3)
    for i, n in enumerate(LENS):
        if window is not None:
            tables[i, :max(0, n - window) // kc.shape[1]] = kc.shape[0] + 1000
    check(mod, (q, kc, vc, tables, lens), window=window, softcap=softcap, scale=scale,
          num_splits=4)


def test_strided_query_and_out_buffer(mod):
    # q as a view into a fused qkv row, written into a caller's buffer; padding entries 0, as a
    # captured graph's table has them.
    q, kc, vc, tables, lens = case(8, 2, [40, 3], seed=5, pad=0)
    qkv = torch.zeros(2, 12, 64, device=DEVICE)
    qkv[:, :8] = q
    out = torch.full_like(q, float("nan"))
    got = mod.paged_decode_attention(qkv[:, :8], kc, vc, tables, lens, out, num_splits=2)
    assert got is out
    torch.testing.assert_close(out.cpu(), reference(q, kc, vc, tables, lens), atol=1e-5,
                               rtol=1e-5)


def test_default_split_choice_runs(mod):
    # One sequence, one kv head, 256 tokens of table: the chooser splits it (4 splits).
    args = case(2, 1, [200], seed=7)
    assert mod.choose_num_splits(1, 1, 256, mod._num_sms(args[0].device)) > 1
    check(mod, args)


def test_split_chooser(mod):
    choose, sms = mod.choose_num_splits, 132
    assert choose(32, 3, 512, sms) == 3  # 96 programs x 3 >= 2 per multiprocessor
    assert choose(1, 8, 4096, sms) == 33  # 8 x 33 >= 264
    assert choose(1, 1, 32768, sms) == mod.MAX_SPLITS
    assert choose(1, 8, 256, sms) == 4  # no split under MIN_SPLIT_TOKENS
    assert choose(128, 8, 2048, sms) == 1  # the batch fills the device: no merge pass
    assert choose(4, 2, 100, sms) == 1  # too short to split
    for batch in (1, 2, 3, 8, 17, 32, 64, 200):
        for kvh in (1, 2, 8):
            for ctx in (16, 64, 100, 512, 2048, 32768):
                s = choose(batch, kvh, ctx, sms)
                assert 1 <= s <= mod.MAX_SPLITS
                assert s == 1 or s * mod.MIN_SPLIT_TOKENS <= ctx
                capped = s == mod.MAX_SPLITS or (s + 1) * mod.MIN_SPLIT_TOKENS > ctx
                assert capped or batch * kvh * s >= mod.PROGRAMS_PER_SM * sms
                assert s == 1 or batch * kvh * (s - 1) < mod.PROGRAMS_PER_SM * sms  # no more


def test_self_check_passes_and_refuses_a_wrong_or_failing_kernel(mod, monkeypatch):
    """The runner's start-up check: the kernel agrees with torch attention in GQA shapes, one
    split and several; a kernel that computes wrongly or does not compile is named instead."""
    dev = torch.device(DEVICE)
    assert mod.self_check(dev, torch.float32, 4, 2, 64, 16) is None
    assert mod.self_check(dev, torch.bfloat16, 8, 1, 64, 16) is None

    def wrong(q, *args, **kw):
        return torch.full_like(q, 0.5)

    assert_self_check_names_faults(mod, "paged_decode_attention", wrong, monkeypatch)
