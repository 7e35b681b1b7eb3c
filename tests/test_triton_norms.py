"""The Triton kernels between a layer's matmuls (`batcher.runtime.triton_norms`) against torch's
ops: the norm with and without the residual add, SiLU x up, a decode step's RoPE and cache write,
their start-up check, and a whole plain model's steps through the layer loop with them against
its modules. Compiled for the GPU
where one is present, else through Triton's interpreter on the CPU (the machinery of
tests/test_triton_attention.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from batcher.runtime.attention import rotate_and_write_kv
from batcher.runtime.token_ops import rms_norm
from tests.test_triton_attention import DEVICE, compiled_already, kernel_module, run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")
MODULE, KERNEL = "batcher.runtime.triton_norms", "_rms_norm_kernel"


def test_interpreted_in_a_fresh_process() -> None:
    if not compiled_already(MODULE, KERNEL):
        pytest.skip("the interpreted tests run in this process")
    run_interpreted(__file__)


@pytest.fixture(scope="module")
def mod():
    with kernel_module(MODULE, KERNEL) as m:
        yield m


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,dim", [(1, 576), (5, 64), (3, 100)])
def test_norms_are_torchs_norms(mod, dtype: torch.dtype, rows: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(rows * dim)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, dim, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype)
    ops = mod.TritonLayerOps(DEVICE)
    plain = ops.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5).cpu()
    want = rms_norm(x, w, 1e-5)
    torch.testing.assert_close(plain.float(), want.float(), rtol=1e-2, atol=1e-5)
    # Rounded where torch rounds: apart only where the sum of squares adds in another order.
    assert (plain != want).float().mean() < 0.05
    summed = x.to(DEVICE, copy=True)
    normed = ops.add_rms_norm(summed, delta.to(DEVICE), w.to(DEVICE), 1e-5).cpu()
    assert torch.equal(summed.cpu(), x + delta)  # the residual stream, summed as torch sums
    torch.testing.assert_close(normed.float(), rms_norm(x + delta, w, 1e-5).float(), rtol=1e-2,
                               atol=1e-5)
    with pytest.raises(ValueError):
        ops.add_rms_norm(summed, delta[:, :-1].contiguous().to(DEVICE), w.to(DEVICE), 1e-5)


def test_silu_times_up_is_torchs_swiglu(mod) -> None:
    gen = torch.Generator().manual_seed(1)
    inter = 1500  # not a multiple of the kernel's block
    gate = torch.linspace(-30, 30, inter)
    up = torch.randn(inter, generator=gen) * 2
    gate_up = torch.stack([torch.cat([gate, up]), torch.cat([gate.flip(0), -up])])
    gate_up = gate_up.to(torch.bfloat16)
    g, u = gate_up.split(inter, dim=-1)
    got = mod.TritonLayerOps(DEVICE).silu_mul(gate_up.to(DEVICE)).cpu()
    assert got.shape == (2, inter)
    want = F.silu(g) * u
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-5)
    assert (got != want).float().mean() < 0.01  # rounded where torch rounds


def test_nan_and_infinity_pass_through_as_torchs_ops_pass_them(mod) -> None:
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, nan, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]], dtype=torch.bfloat16)
    delta = torch.tensor([[0.0, 0.0, 0.0, 0.0], [inf, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    w = torch.ones(4, dtype=torch.bfloat16)
    ops = mod.TritonLayerOps(DEVICE)
    summed = x.to(DEVICE, copy=True)
    normed = ops.add_rms_norm(summed, delta.to(DEVICE), w.to(DEVICE), 1e-5).cpu()
    want = rms_norm(x + delta, w, 1e-5)
    assert summed.cpu()[1, 0] == inf  # no NaN or inf rounds to a number
    assert torch.equal(normed.isnan(), want.isnan()) and torch.equal(normed[1, 1:], want[1, 1:])
    gate_up = torch.tensor([[nan, 1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    assert ops.silu_mul(gate_up.to(DEVICE)).cpu()[0, 0].isnan()


def test_the_start_up_check_passes_and_names_a_wrong_kernel(mod, monkeypatch) -> None:
    dev = torch.device(DEVICE)
    assert mod.self_check(dev, torch.bfloat16, 576, 1536) is None
    real = mod._norm

    def off_by_one(x, delta, weight, eps):
        return real(x, delta, weight, eps) + 1

    monkeypatch.setattr(mod, "_norm", off_by_one)
    assert "differs from torch's ops" in mod.self_check(dev, torch.bfloat16, 64, 96)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16)])
def test_rope_and_the_cache_write_are_torchs(mod, dtype: torch.dtype, heads: int, kv_heads: int,
                                             head_dim: int) -> None:
    gen = torch.Generator().manual_seed(heads * head_dim)
    rows, width = 5, (heads + 2 * kv_heads) * head_dim
    # Rows of a wider tensor (a row stride past their width), as a projection's view may be.
    qkv = (4 * torch.randn(rows, width + 8, generator=gen)).to(dtype)[:, :width]
    angle = torch.rand(rows, 1, head_dim, generator=gen) * 50
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    slots = torch.tensor([7, 0, 12, 3, 9])
    want_cache = tuple(torch.zeros(8, 2, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    want = rotate_and_write_kv(qkv, cos, sin, want_cache, slots, heads, kv_heads, head_dim)
    cache = tuple(torch.zeros_like(c, device=DEVICE) for c in want_cache)
    got = mod.TritonLayerOps.rope_cache(qkv.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), cache,
                                        slots.to(DEVICE), heads, kv_heads, head_dim)
    assert torch.equal(got.cpu(), want)  # rounded where torch rounds: bit for bit
    assert torch.equal(cache[0].cpu(), want_cache[0]) and torch.equal(cache[1].cpu(),
                                                                      want_cache[1])
    with pytest.raises(ValueError):
        mod.TritonLayerOps.rope_cache(qkv.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), cache,
                                      slots.to(DEVICE), heads, kv_heads, head_dim // 2)


def test_the_start_up_check_of_rope_and_the_cache_write(mod, monkeypatch) -> None:
    dev = torch.device(DEVICE)
    assert mod.check_rope_cache(dev, torch.bfloat16, 4, 2, 16) is None
    assert "power of two" in mod.check_rope_cache(dev, torch.bfloat16, 4, 2, 12)
    monkeypatch.setattr(mod.TritonLayerOps, "rope_cache", staticmethod(
        lambda qkv, cos, sin, cache, slots, heads, kv_heads, head_dim:
        qkv[:, :heads * head_dim].reshape(-1, heads, head_dim)))  # no rotation, no write
    assert "RoPE" in mod.check_rope_cache(dev, torch.bfloat16, 4, 2, 16)


class CountedRopeCache:
    """The ops' `rope_cache`, each call counted in `calls`."""

    def __init__(self, ops, calls: list[int]) -> None:
        self.ops, self.calls = ops, calls
        self.takes_rope_cache = ops.takes_rope_cache

    def rope_cache(self, *args):
        self.calls.append(1)
        return self.ops.rope_cache(*args)


def test_a_decode_step_through_the_loop_reads_and_writes_the_cache_as_the_modules_do(
        mod) -> None:
    """A decode-only step on the triton attention backend: RoPE and the cache write in one
    kernel, then the decode kernel, against the loop with `Attention.attend` and the modules."""
    from batcher.core.outputs import ScheduledSeq, SchedulerOutput
    from batcher.core.sampling import SamplingParams
    from batcher.models.llama_layer_loop import LayerLoop
    from batcher.models.loader import load_model
    from batcher.runtime.model_runner import ModelRunner

    loaded = load_model("tiny", dtype="bfloat16", device=DEVICE)
    model = loaded.model
    ops = mod.TritonLayerOps(DEVICE)
    loop = LayerLoop.for_model(model, ops)
    assert loop is not None and loop.rope_cache is ops
    runner = ModelRunner(loaded, num_blocks=32, block_size=16)
    greedy = SamplingParams(temperature=0.0)
    prompt = SchedulerOutput([ScheduledSeq("a", list(range(5, 25)), 0, [0, 1], True, greedy),
                              ScheduledSeq("b", [6, 7, 8], 0, [2], True, greedy)])
    step = SchedulerOutput([ScheduledSeq("a", [5], 20, [0, 1], True, greedy),
                            ScheduledSeq("b", [6], 3, [2], True, greedy)])
    calls: list[int] = []
    spy = CountedRopeCache(ops, calls)
    results = {}
    model.layer_loop = None
    with torch.inference_mode():
        runner.execute(prompt)  # the prompts' K/V in the cache
        base = [tuple(c.clone() for c in kv) for kv in runner.kv_caches]
        for case in ("modules", "attend", "fused"):
            for kv, saved in zip(runner.kv_caches, base):
                kv[0].copy_(saved[0])
                kv[1].copy_(saved[1])
            ids, pos, meta, idx, _ = runner.prepare(step)
            meta.fused = None  # the triton backend's metadata: the decode kernel reads tables
            meta.decode_tables = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
            meta.decode_lens = torch.tensor([21, 4], dtype=torch.int32)
            model.layer_loop = None if case == "modules" else loop
            loop.rope_cache = spy if case == "fused" else None
            assert case == "modules" or loop.takes(model.embed_tokens(ids), meta)
            assert ops.takes_rope_cache(meta, ids.shape[0], loop.heads[2])
            logits = model(ids, pos, meta, runner.kv_caches, idx).float().cpu()
            results[case] = (logits, [tuple(c.clone() for c in kv) for kv in runner.kv_caches])
    model.layer_loop, loop.rope_cache = None, ops
    assert len(calls) == len(model.layers)  # every layer of the fused step, no other step
    fused, attend = results["fused"], results["attend"]
    assert torch.equal(fused[0], attend[0])  # the same function, bit for bit
    assert all(torch.equal(a, b) for x, y in zip(fused[1], attend[1]) for a, b in zip(x, y))
    assert torch.equal(fused[0].argmax(-1), results["modules"][0].argmax(-1))
    torch.testing.assert_close(fused[0], results["modules"][0], rtol=0.02, atol=0.02)


def test_a_plain_models_steps_through_the_loop_are_its_modules_steps(mod) -> None:
    """Every step (decode rows and a prompt chunk together) of the tiny model in bf16 through
    the layer loop with the Triton kernels, against its modules."""
    from batcher.core.outputs import ScheduledSeq, SchedulerOutput
    from batcher.core.sampling import SamplingParams
    from batcher.models.llama_layer_loop import LayerLoop
    from batcher.models.loader import load_model
    from batcher.runtime.model_runner import ModelRunner

    loaded = load_model("tiny", dtype="bfloat16", device=DEVICE)
    model = loaded.model
    loop = LayerLoop.for_model(model, mod.TritonLayerOps(DEVICE))
    assert loop is not None
    runner = ModelRunner(loaded, num_blocks=32, block_size=16)
    greedy = SamplingParams(temperature=0.0)
    step = SchedulerOutput([ScheduledSeq("a", [5], 20, [0, 1], True, greedy),
                            ScheduledSeq("b", [6], 3, [2], True, greedy),
                            ScheduledSeq("c", [7, 8, 9], 0, [3], True, greedy)])
    ids, pos, meta, idx, _ = runner.prepare(step)
    model.layer_loop = None
    with torch.inference_mode():
        modules = model(ids, pos, meta, runner.kv_caches, idx).float().cpu()
        model.layer_loop = loop
        assert loop.takes(model.embed_tokens(ids), meta)
        looped = model(ids, pos, meta, runner.kv_caches, idx).float().cpu()
    assert torch.equal(looped.argmax(-1), modules.argmax(-1))
    torch.testing.assert_close(looped, modules, rtol=0.02, atol=0.02)


def test_the_loader_attaches_the_loop_only_where_the_kernels_pass_their_check(
        mod, monkeypatch) -> None:
    from batcher.models import loader
    from batcher.models.llama_layer_loop import LayerLoop

    model = loader.load_model("tiny", dtype="bfloat16", device="cpu").model
    model.layer_loop = None
    dev = torch.device(DEVICE)
    loader._attach_gpu_layer_loop(model, dev, torch.bfloat16)
    assert isinstance(model.layer_loop, LayerLoop)
    assert isinstance(model.layer_loop.ops, mod.TritonLayerOps)
    assert model.layer_loop.rope_cache is model.layer_loop.ops
    model.layer_loop = None
    monkeypatch.setenv("BATCHER_LAYER_LOOP", "0")  # off, to compare
    loader._attach_gpu_layer_loop(model, dev, torch.bfloat16)
    assert model.layer_loop is None
    monkeypatch.delenv("BATCHER_LAYER_LOOP")
    monkeypatch.setattr(mod, "check_rope_cache", lambda *a: "differs")
    loader._attach_gpu_layer_loop(model, dev, torch.bfloat16)
    assert model.layer_loop is not None and model.layer_loop.rope_cache is None  # attend
    model.layer_loop = None
    monkeypatch.setattr(mod, "self_check", lambda *a: "differs")
    loader._attach_gpu_layer_loop(model, dev, torch.bfloat16)
    assert model.layer_loop is None  # the modules' path
