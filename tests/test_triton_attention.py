"""The fused paged decode kernel against the torch reference path. Runs on CUDA, or on the CPU
through Triton's interpreter when Triton is installed; skipped otherwise."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")


@pytest.fixture(scope="module")
def kernel():
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel module is imported
    from batcher.runtime.triton_attention import paged_decode_attention

    return paged_decode_attention


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 2)])
def test_kernel_matches_reference(kernel, heads, kv_heads):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(heads)
    d, bs, nb = 64, 16, 24
    kc = torch.randn(nb, bs, kv_heads, d, generator=gen).to(dev)
    vc = torch.randn(nb, bs, kv_heads, d, generator=gen).to(dev)
    q = torch.randn(4, heads, d, generator=gen).to(dev)
    lens = torch.tensor([1, 17, 40, 64], dtype=torch.int32, device=dev)
    tables = torch.tensor([[5, 0, 0, 0], [3, 9, 0, 0], [1, 4, 11, 0], [2, 6, 8, 23]],
                          dtype=torch.int32, device=dev)
    out = kernel(q, kc, vc, tables, lens)
    for i in range(4):
        n = int(lens[i])
        blocks = tables[i, : -(-n // bs)].long()
        k = kc[blocks].reshape(-1, kv_heads, d)[:n].repeat_interleave(heads // kv_heads, 1)
        v = vc[blocks].reshape(-1, kv_heads, d)[:n].repeat_interleave(heads // kv_heads, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[i][:, None], k.transpose(0, 1), v.transpose(0, 1))[:, 0]
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)


def test_runner_with_kernel_matches_torch_path(kernel, tiny_fp32):
    from batcher.runtime.model_runner import ModelRunner
    from tests.greedy_loop import greedy_generate

    prompts = [[100 + i * 7 + j for j in range(10 + 5 * i)] for i in range(3)]
    ref = greedy_generate(ModelRunner(tiny_fp32, 32, 16, attention_backend="torch"), prompts, 6)
    fused = ModelRunner(tiny_fp32, 32, 16, attention_backend="triton", cuda_graphs=False)
    assert fused.backend == "triton"
    assert greedy_generate(fused, prompts, 6) == ref
