"""The varlen paged prefill kernel against the torch reference path: compiled for the GPU with
CUDA tensors where one is present, else on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, CPU tensors); skipped where Triton is not installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from batcher.runtime.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillChunk,
    paged_attention,
)
from batcher.runtime.variant_attention import AttentionVariant, variant_attention
from tests.test_triton_attention import (
    DEVICE,
    assert_self_check_names_faults,
    compiled_already,
    kernel_module,
    run_interpreted,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")

MODULE = "batcher.runtime.triton_prefill"


def test_interpreted_in_a_fresh_process() -> None:
    if not compiled_already(MODULE, "_paged_prefill_kernel"):
        pytest.skip("the interpreted tests run in this process")
    run_interpreted(__file__)


@pytest.fixture(scope="module")
def kernel():
    """The module in the mode DEVICE needs (as in test_triton_attention)."""
    with kernel_module(MODULE, "_paged_prefill_kernel") as mod:
        yield mod


def make_step(gen: torch.Generator, lengths: list[int], prefixes: list[int], heads: int,
              kv_heads: int, hd: int, dtype: torch.dtype, bs: int = 16, decodes: int = 0):
    """A step of `decodes` single-token rows, then one chunk per (length, prefix): random new
    Q/K/V, a cache holding random prefixes in shuffled blocks, each chunk's K/V written."""
    nb = sum(-(-(n + p) // bs) for n, p in zip(lengths, prefixes)) + decodes * 2 + 3
    kc = torch.randn(nb, bs, kv_heads, hd, generator=gen).to(DEVICE, dtype)
    vc = torch.randn(nb, bs, kv_heads, hd, generator=gen).to(DEVICE, dtype)
    perm = torch.randperm(nb, generator=gen).tolist()
    t = decodes + sum(lengths)
    # As the model hands them over: q and k side by side in one tensor, v a strided view.
    qkv = torch.randn(t, heads + 2 * kv_heads, hd, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    slots: list[int] = []
    groups: list[DecodeGroup] = []
    if decodes:  # each decode row: a 2-block context, its token at position 20
        tables = [perm[-2 * i - 2:len(perm) - 2 * i] for i in range(decodes)]
        slots += [b[1] * bs + 4 for b in tables]
        keys = torch.arange(2 * bs, device=DEVICE)
        groups.append(DecodeGroup(decodes, 2, torch.tensor(sum(tables, []), device=DEVICE),
                                  (keys < 21).expand(decodes, 1, 1, 2 * bs)))
    chunks, row, nxt = [], decodes, 0
    for n, p in zip(lengths, prefixes):
        blocks = perm[nxt:nxt + -(-(n + p) // bs)]
        nxt += len(blocks)
        slots += [blocks[i // bs] * bs + i % bs for i in range(p, p + n)]
        mask = None
        if p:
            q_pos = torch.arange(p, p + n, device=DEVICE)[:, None]
            mask = torch.arange(p + n, device=DEVICE) <= q_pos  # bottom-right causal
        chunks.append(PrefillChunk(row=row, length=n, start_pos=p, mask=mask,
                                   block_ids=torch.tensor(blocks, device=DEVICE)))
        row += n
    meta = AttentionMetadata(block_size=bs, num_decodes=decodes, decode_groups=groups,
                             prefills=chunks, fold_gqa=False,
                             slot_mapping=torch.tensor(slots, device=DEVICE))
    return q, k, v, (kc, vc), meta


def reference(q, k, v, kv_cache, meta, spec=None):
    """The torch path on copies of the cache (it writes the new K/V too)."""
    cache = (kv_cache[0].clone(), kv_cache[1].clone())
    meta.triton_prefill = False
    if spec is None:
        return paged_attention(q, k, v, cache, meta)
    return variant_attention(q, k, v, cache, meta, spec)


def run_kernel(mod, q, k, v, kv_cache, meta, **kw):
    from batcher.runtime.attention import write_kv

    write_kv(k, v, kv_cache, meta.slot_mapping)
    out = torch.zeros(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=DEVICE)
    batch = mod.VarlenPrefill.build(meta.prefills, q.device)
    return mod.paged_prefill_attention(q, k, v, *kv_cache, batch, out, **kw)


# Chunk lengths and cached prefixes: a first chunk, prefixes inside a block and past several,
# a one-token chunk, a chunk longer than a query tile.
LENGTHS = [5, 13, 1, 70]
PREFIXES = [0, 7, 101, 21]


@pytest.mark.parametrize("kv_heads,hd,dtype", [
    (4, 64, torch.float32), (2, 128, torch.float32), (1, 64, torch.float32),
    (2, 64, torch.bfloat16), (1, 128, torch.float16)])
def test_kernel_matches_reference(kernel, kv_heads, hd, dtype):
    gen = torch.Generator().manual_seed(kv_heads * hd)
    heads = 4
    q, k, v, cache, meta = make_step(gen, LENGTHS, PREFIXES, heads, kv_heads, hd, dtype)
    ref = reference(q, k, v, cache, meta)
    out = run_kernel(kernel, q, k, v, cache, meta)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("spec", [AttentionVariant(window=9),
                                  AttentionVariant(scale=0.05, softcap=3.0)])
def test_kernel_variants_match_reference(kernel, spec):
    gen = torch.Generator().manual_seed(7)
    q, k, v, cache, meta = make_step(gen, [12, 40, 3], [0, 29, 150], 4, 2, 64, torch.float32)
    ref = reference(q, k, v, cache, meta, spec)
    out = run_kernel(kernel, q, k, v, cache, meta, scale=spec.scale, window=spec.window,
                     softcap=spec.softcap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,spec", [(torch.float32, AttentionVariant()),
                                        (torch.bfloat16, AttentionVariant()),
                                        (torch.float32, AttentionVariant(window=9, softcap=3.0))])
def test_own_keys_from_the_cache_are_the_rows_own_keys(kernel, dtype, spec):
    """With the step's K/V already written, reading the chunks' own keys through the block
    tables computes what reading the step's rows does, bit for bit (the same values, the same
    order of operations)."""
    gen = torch.Generator().manual_seed(11)
    q, k, v, cache, meta = make_step(gen, LENGTHS, PREFIXES, 4, 2, 64, dtype)
    kw = dict(scale=spec.scale, window=spec.window, softcap=spec.softcap)
    rows = run_kernel(kernel, q, k, v, cache, meta, **kw)  # writes the step's K/V first
    out = torch.zeros_like(rows)
    batch = kernel.VarlenPrefill.build(meta.prefills, q.device)
    cached = kernel.paged_prefill_attention(q, None, None, *cache, batch, out, **kw)
    assert torch.equal(cached, rows)


def test_mixed_step_dispatch(kernel, monkeypatch):
    """`paged_attention` with the kernel switched on: decode rows on their own path, the prefill
    rows of the same step in one launch, every row equal to the torch path's."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, cache, meta = make_step(gen, [6, 19], [0, 18], 8, 2, 64, torch.bfloat16, decodes=3)
    ref = reference(q, k, v, cache, meta)
    meta.triton_prefill = True
    calls = []
    launch = kernel.paged_prefill_attention
    monkeypatch.setattr(kernel, "paged_prefill_attention",
                        lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    out = paged_attention(q, k, v, cache, meta)
    assert len(calls) == 1 and meta.varlen is not None
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_dispatch_follows_the_backend_switch():
    from batcher.runtime.attention import _prefill_in_kernel

    chunk = PrefillChunk(row=0, length=4, start_pos=0, block_ids=torch.zeros(1), mask=None)
    meta = AttentionMetadata(block_size=16, slot_mapping=torch.zeros(4), prefills=[chunk])
    cpu = torch.zeros(1)
    assert not _prefill_in_kernel(meta, cpu)  # the torch backend: no decode tables
    meta.decode_tables = torch.zeros(1, 1)
    assert not _prefill_in_kernel(meta, cpu)  # the CPU keeps the torch path
    meta.triton_prefill = True
    assert _prefill_in_kernel(meta, cpu)
    chunk.stage = object()  # a CPU prompt's staged K/V: the torch path
    assert not _prefill_in_kernel(meta, cpu)


def test_model_mixed_step(kernel, tiny_fp32):
    """The tiny model's forward over a mixed step the runner prepared (a decode row, a continued
    chunk, a new prompt): every row's logits equal to the torch path's."""
    from batcher.core.outputs import ScheduledSeq, SchedulerOutput
    from batcher.core.sampling import SamplingParams
    from batcher.runtime.model_runner import ModelRunner

    if DEVICE != "cpu":
        pytest.skip("the CPU's tiny model")
    runner = ModelRunner(tiny_fp32, 16, 8, attention_backend="torch")
    runner.staging = None  # staged K/V would send the chunks down the torch path
    greedy = SamplingParams(temperature=0.0)
    a, b, c = ([100 + 3 * i for i in range(n)] for n in (13, 30, 11))
    tables = [[0, 1], [2, 3, 4, 5], [6, 7]]
    first = SchedulerOutput([ScheduledSeq("a", a, 0, tables[0], True, greedy),
                             ScheduledSeq("b", b[:19], 0, tables[1], False, greedy)])
    ids, pos, meta, idx, _ = runner.prepare(first)
    runner.model(ids, pos, meta, runner.kv_caches, idx)
    mixed = SchedulerOutput([ScheduledSeq("a", [7], 13, tables[0], True, greedy),
                             ScheduledSeq("b", b[19:], 19, tables[1], True, greedy),
                             ScheduledSeq("c", c, 0, tables[2], True, greedy)])
    caches = [(kc.clone(), vc.clone()) for kc, vc in runner.kv_caches]
    logits = []
    for on in (False, True):
        ids, pos, meta, _, _ = runner.prepare(mixed)
        assert meta.num_decodes == 1 and len(meta.prefills) == 2
        meta.triton_prefill = on
        kv = [(kc.clone(), vc.clone()) for kc, vc in caches]
        logits.append(runner.model(ids, pos, meta, kv, torch.arange(len(ids))))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


def test_self_check_passes_and_refuses_a_wrong_or_failing_kernel(kernel, monkeypatch):
    """The runner's start-up check: the kernel agrees with torch attention in GQA shapes, and
    a kernel that computes wrongly or does not compile is named, so the runner keeps torch."""
    dev = torch.device(DEVICE)
    assert kernel.self_check(dev, torch.float32, 4, 2, 64, 16) is None
    assert kernel.self_check(dev, torch.bfloat16, 2, 1, 64, 16) is None

    def wrong(q, k, v, kc, vc, batch, out, **kw):
        return out.fill_(0.5)

    assert_self_check_names_faults(kernel, "paged_prefill_attention", wrong, monkeypatch)
