"""The fused CPU decode kernels compute what torch's ops compute: the norm, and RoPE + the KV
write + paged attention, for any mix of rows, context lengths and GQA groups; decode-only bf16
steps take them, everything else keeps the torch path; and where they cannot be had, nothing
changes but speed."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batcher.core.outputs import ScheduledSeq, SchedulerOutput
from batcher.models.llama import RMSNorm
from batcher.models.llama_layer_loop import LayerLoop
from batcher.runtime import fused_decode
from batcher.runtime.attention import FusedDecodeStep
from batcher.runtime.fused_decode import FusedDecode, reference_attention
from batcher.runtime.token_ops import apply_rope, rms_norm
from batcher.runtime.model_runner import ModelRunner
from batcher.runtime.step_inputs import step_inputs
from batcher.core.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")),
                                reason="no C compiler")
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> FusedDecode:
    k = fused_decode.load(tmp_path_factory.mktemp("kernels"))
    assert k is not None
    return k


@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 64), (64, 2048), (3, 24)])
def test_norm_is_torchs_norm(kernels: FusedDecode, rows: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(torch.bfloat16)
    want = rms_norm(x, w, 1e-5)
    got = kernels.rms_norm(x, w, 1e-5)
    # The sum of squares may add in another order: at most one bf16 step apart, rarely.
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-6)
    assert (got != want).float().mean() < 0.05


@pytest.mark.parametrize("rows,dim", [(1, 576), (5, 64)])
def test_add_then_norm_is_torchs_add_then_norm(kernels: FusedDecode, rows: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(dim)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(torch.bfloat16)
    delta = torch.randn(rows, dim, generator=gen).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(torch.bfloat16)
    summed = x.clone()
    got = kernels.add_rms_norm(summed, delta, w, 1e-5)
    assert torch.equal(summed, x + delta)  # the residual stream, summed in place as torch sums
    torch.testing.assert_close(got.float(), rms_norm(x + delta, w, 1e-5).float(), rtol=8e-3,
                               atol=1e-6)
    with pytest.raises(ValueError):
        kernels.add_rms_norm(summed, delta[:, :-1].contiguous(), w, 1e-5)


def test_silu_times_up_is_torchs_swiglu(kernels: FusedDecode) -> None:
    gen = torch.Generator().manual_seed(1)
    gate = torch.cat([torch.linspace(-30, 30, 961), torch.zeros(1), torch.randn(62, generator=gen)])
    up = torch.randn(1024, generator=gen) * 2
    gate_up = torch.stack([torch.cat([gate, up]), torch.cat([gate.flip(0), -up])])
    gate_up = gate_up.to(torch.bfloat16)
    g, u = gate_up.split(1024, dim=-1)
    want = F.silu(g) * u
    got = kernels.silu_mul(gate_up)
    assert got.shape == (2, 1024)
    # The kernel's exponential is its own: now and then one bf16 step apart, never more.
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-6)
    assert (got != want).float().mean() < 0.01
    with pytest.raises(ValueError):
        kernels.silu_mul(gate_up.float())


def _random_step(kernels: FusedDecode, lens: list[int], block_size: int, kv_heads: int,
                 head_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_row) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # blocks anywhere in the pool
    tables, slots, start = [], [], 0
    for n, b in zip(lens, per_row):
        row = perm[start:start + b]
        start += b
        slots.append(row[(n - 1) // block_size] * block_size + (n - 1) % block_size)
        tables.append(row + [0] * (max(per_row) - b))
    step = FusedDecodeStep(kernels, block_size, torch.tensor(slots),
                           torch.tensor(tables, dtype=torch.int32),
                           torch.tensor(lens, dtype=torch.int32))
    return k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16), step, gen


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,lens", [
    (9, 3, 64, 16, [1, 17, 250]),  # the bundled model's shape, a fresh and two deep rows
    (4, 4, 32, 8, [5, 40]),  # no GQA
    (8, 1, 16, 4, [3]),  # one KV head for all
    (4, 2, 16, 16, [16, 32, 33, 1, 2]),  # block edges
])
def test_attention_is_torchs_attention(kernels: FusedDecode, heads: int, kv_heads: int,
                                       head_dim: int, block_size: int, lens: list[int]) -> None:
    assert kernels.takes_attention(heads, kv_heads, head_dim)
    k_cache, v_cache, step, gen = _random_step(kernels, lens, block_size, kv_heads, head_dim,
                                               seed=len(lens) * heads)
    rows = len(lens)
    width = (heads + 2 * kv_heads) * head_dim
    # Row-strided, as the model hands over Q/K/V: a view into a wider activation.
    qkv = torch.randn(rows, width + 8, generator=gen).to(torch.bfloat16)[:, :width]
    angle = torch.rand(rows, 1, head_dim // 2, generator=gen) * 50
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(torch.bfloat16)
    sin = torch.cat((-angle.sin(), angle.sin()), -1).to(torch.bfloat16)
    mine = (k_cache.clone(), v_cache.clone())
    got = kernels.attend(qkv, cos, sin, mine, step, heads, kv_heads, head_dim)
    want = reference_attention(qkv, cos, sin, (k_cache, v_cache), step, heads, kv_heads,
                               head_dim)
    assert got.shape == (rows, heads * head_dim)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2)
    assert torch.equal(mine[0], k_cache) and torch.equal(mine[1], v_cache)  # same K/V written
    # A mixed step's decode rows: Q rotated and K/V written by torch's ops, attention alone.
    q = apply_rope(qkv[:, :heads * head_dim].reshape(rows, heads, head_dim), cos, sin)
    rotated = kernels.attend_rotated(q, mine, step)
    torch.testing.assert_close(rotated.float(), want.float(), rtol=2e-2, atol=1e-2)


def test_shapes_the_kernel_cannot_take_are_refused(kernels: FusedDecode) -> None:
    assert not kernels.takes_attention(34, 2, 64)  # a GQA group of 17
    assert not kernels.takes_attention(4, 4, 512)
    assert not kernels.takes_norm(torch.zeros(65, 64, dtype=torch.bfloat16))  # torch's, threaded
    assert not kernels.takes_norm(torch.zeros(2, 64))  # fp32
    assert not kernels.takes_norm(torch.zeros(64, 2, dtype=torch.bfloat16).t())


def test_a_table_outside_the_pool_is_refused_before_anything_is_written(
        kernels: FusedDecode) -> None:
    k_cache, v_cache, step, gen = _random_step(kernels, [5, 9], 4, 2, 16, seed=3)
    before = (k_cache.clone(), v_cache.clone())
    qkv = torch.randn(2, 8 * 16, generator=gen).to(torch.bfloat16)
    cos = torch.ones(2, 1, 16, dtype=torch.bfloat16)
    sin = torch.zeros(2, 1, 16, dtype=torch.bfloat16)
    step.tables[1, 2] = k_cache.shape[0]  # one block past the pool
    with pytest.raises(ValueError):
        kernels.attend(qkv, cos, sin, (k_cache, v_cache), step, 4, 2, 16)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    with pytest.raises(ValueError):
        kernels.attend_rotated(qkv[:, :64].reshape(2, 4, 16), (k_cache, v_cache), step)
    with pytest.raises(ValueError):  # fp32 rows would be read as bf16
        kernels.attend(qkv.float(), cos, sin, (k_cache, v_cache), step, 4, 2, 16)


def test_big_steps_on_many_threads_keep_torchs_parallel_path(kernels: FusedDecode) -> None:
    assert kernels.takes_step(2, 64 * 2048)  # one thread beat two at every size measured
    assert kernels.takes_step(16, 8 * 256)  # small steps: the per-op cost dominates
    assert not kernels.takes_step(16, 64 * 2048)


def test_off_or_unbuildable_means_the_torch_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("BATCHER_CPU_KERNELS", "0")
    assert fused_decode.load(tmp_path) is None
    monkeypatch.delenv("BATCHER_CPU_KERNELS")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="batcher.runtime.fused_decode"):
        assert fused_decode.load(tmp_path / "none") is None
    assert "torch's ops" in caplog.text


def _step(runner: ModelRunner, seqs: list[ScheduledSeq]):
    return runner.prepare(SchedulerOutput(list(seqs)))


def test_runner_fuses_decode_only_bf16_steps() -> None:
    from batcher.models.loader import load_model

    bf16 = load_model("tiny", dtype="bfloat16", device="cpu")
    assert bf16.fused is not None
    assert all(m.fused is bf16.fused for m in bf16.model.modules() if isinstance(m, RMSNorm))
    runner = ModelRunner(bf16, num_blocks=32, block_size=16)
    decode = [ScheduledSeq("a", [5], 20, [0, 1], True, GREEDY),
              ScheduledSeq("b", [6], 3, [2], True, GREEDY)]
    prefill = ScheduledSeq("c", [7, 8, 9], 0, [3], True, GREEDY)
    _, _, meta, _, _ = _step(runner, decode)
    assert meta.fused is not None and not meta.decode_groups
    assert meta.fused.lens.tolist() == [21, 4] and meta.fused.tables.tolist() == [[0, 1], [2, 0]]
    ids, pos, mixed, idx, _ = _step(runner, [*decode, prefill])
    # A mixed step: its decode rows through the kernel, its prompt chunk through torch's ops.
    assert mixed.fused is not None and not mixed.decode_groups
    assert mixed.fused.slots.tolist() == mixed.slot_mapping[:2].tolist()
    with_kernel = runner.model(ids, pos, mixed, runner.kv_caches, idx)
    # The same step with its decode rows kept off the kernel (as a compiled graph's step is).
    _, _, plain, _, _ = step_inputs(runner, SchedulerOutput([*decode, prefill]),
                                    fuse_decodes=False)
    assert plain.fused is None and plain.decode_groups
    without = runner.model(ids, pos, plain, runner.kv_caches, idx).float()
    # bf16 rounding apart: the same choices, logits within a few hundredths.
    assert torch.equal(without.argmax(-1), with_kernel.float().argmax(-1))
    assert (without - with_kernel.float()).abs().max() < 0.1
    fp32 = load_model("tiny", dtype="float32", device="cpu")
    assert fp32.fused is None  # fp32 keeps torch's ops (and the exact-reference tests)
    _, _, meta32, _, _ = _step(ModelRunner(fp32, num_blocks=32, block_size=16), decode)
    assert meta32.fused is None


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_small_decode_only_steps_run_the_layer_loop_and_compute_the_modules_step(
        monkeypatch: pytest.MonkeyPatch, qkv_bias: bool) -> None:
    from batcher.models.loader import load_model

    loaded = load_model("tiny", dtype="bfloat16", device="cpu")
    model = loaded.model
    if qkv_bias:  # as Qwen2's attention has
        torch.manual_seed(0)
        for layer in model.layers:
            proj = layer.self_attn.qkv_proj
            biased = torch.nn.Linear(proj.in_features, proj.out_features, bias=True)
            biased.weight.data, biased.bias.data = proj.weight.data, torch.randn(
                proj.out_features).to(torch.bfloat16)
            layer.self_attn.qkv_proj = biased
        model.layer_loop = LayerLoop.for_model(model, loaded.fused)
    loop = model.layer_loop
    assert isinstance(loop, LayerLoop)
    runner = ModelRunner(loaded, num_blocks=32, block_size=16)
    ran = []
    run = loop.run
    monkeypatch.setattr(loop, "run", lambda *a: ran.append(a[0].shape[0]) or run(*a))
    decode = [ScheduledSeq("a", [5], 20, [0, 1], True, GREEDY),
              ScheduledSeq("b", [6], 3, [2], True, GREEDY)]
    ids, pos, meta, idx, _ = _step(runner, decode)
    looped = model(ids, pos, meta, runner.kv_caches, idx).float()
    assert ran == [2]
    model.layer_loop = None
    try:
        modules = model(ids, pos, meta, runner.kv_caches, idx).float()
    finally:
        model.layer_loop = loop
    assert torch.equal(looped.argmax(-1), modules.argmax(-1))
    torch.testing.assert_close(looped, modules, rtol=0.02, atol=0.02)
    # A step with a prompt chunk, and a step of more rows than the C norms take, keep the
    # modules' path.
    ids, pos, mixed, idx, _ = _step(runner, [*decode, ScheduledSeq("c", [7, 8], 0, [3], True,
                                                                   GREEDY)])
    model(ids, pos, mixed, runner.kv_caches, idx)
    many = [ScheduledSeq(f"r{i}", [5], 2, [4 + i // 4], True, GREEDY) for i in range(65)]
    ids, pos, wide, idx, _ = _step(runner, many)
    model(ids, pos, wide, runner.kv_caches, idx)
    assert ran == [2]


def test_the_loop_is_for_plain_llama_layers_only() -> None:
    from batcher.models.llama import MLP
    from batcher.models.loader import load_model

    loaded = load_model("tiny", dtype="bfloat16", device="cpu")
    assert LayerLoop.for_model(loaded.model, loaded.fused) is not None

    class OtherMLP(MLP):  # a variant's part (a mixture of experts, GeGLU) is not the loop's
        pass

    layer = loaded.model.layers[-1]
    layer.mlp = OtherMLP(loaded.config)
    assert LayerLoop.for_model(loaded.model, loaded.fused) is None


# Where greedy decoding through the fused kernels and through torch's ops part, the gap between
# torch's pick and the fused pick, in torch's logits at that step, as a share of the largest
# logit: bf16 rounding flips only near-ties.
NEAR_TIE = 0.01


@pytest.mark.slow
def test_bundled_model_decodes_the_same_tokens_fused_and_not(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """The claim on the real model: greedy decoding through the fused kernels picks the tokens
    torch's ops pick (bf16, dense weights) but at near-ties, and its logits stay within bf16
    noise."""
    from batcher.models.loader import load_model

    loaded = load_model("smollm2-135m", dtype="bfloat16", device="cpu")
    assert loaded.fused is not None
    from batcher.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer()
    prompts = ["The capital of France is", "def fibonacci(n):\n    ",
               "Water boils at a temperature of", "Once upon a time, in a small village,"]
    runs = {}
    for fused in (True, False):
        runner = ModelRunner(loaded, num_blocks=64, block_size=16)
        runner.fused = loaded.fused if fused else None
        for m in loaded.model.modules():
            if isinstance(m, RMSNorm):
                m.fused = loaded.fused if fused else None
        seqs = {f"r{i}": tok.encode(p) for i, p in enumerate(prompts)}
        tables = {rid: list(range(16 * i, 16 * i + 16)) for i, rid in enumerate(seqs)}
        out = runner.execute(SchedulerOutput([ScheduledSeq(rid, ids, 0, tables[rid], True, GREEDY)
                                              for rid, ids in seqs.items()]))
        tokens = {rid: [t] for rid, t in zip(out.request_ids, out.token_ids)}
        logits = []
        for _ in range(24):  # decode-only steps of all four rows
            step = [ScheduledSeq(rid, [tokens[rid][-1]], len(seqs[rid]) + len(tokens[rid]) - 1,
                                 tables[rid], True, GREEDY) for rid in seqs]
            ids, pos, meta, idx, _ = runner.prepare(SchedulerOutput(step))
            assert (meta.fused is not None) == fused
            logits.append(runner.model(ids, pos, meta, runner.kv_caches, idx))
            out = runner.execute(SchedulerOutput(step))  # writes the same K/V again, samples
            for rid, t in zip(out.request_ids, out.token_ids):
                tokens[rid].append(t)
        runs[fused] = tokens, logits
    (fused_tokens, fused_logits), (torch_tokens, torch_logits) = runs[True], runs[False]
    first = (fused_logits[0] - torch_logits[0]).abs().max().item()
    scale = torch_logits[0].abs().max().item()
    assert first < 0.05 * scale
    # Where the two part, torch's own logits at that step (same context so far) must rate the
    # fused path's pick a near-tie: a flip there is bf16 rounding (how often depends on the
    # CPU: one without native bf16 rounds differently), a flip by more is a wrong kernel.
    gaps = []
    for row, rid in enumerate(torch_tokens):
        ours, ref = fused_tokens[rid], torch_tokens[rid]
        at = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if at is None:
            continue
        assert at > 0, f"{rid}: the first token after the prompt differs"
        logits = torch_logits[at - 1][row].float()
        gaps.append((logits[ref[at]] - logits[ours[at]]).item())
    assert all(g <= NEAR_TIE * scale for g in gaps), (gaps, scale)
