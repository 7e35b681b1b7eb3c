"""The runner's start-up checks of its Triton kernels on CUDA: a decode kernel that fails keeps
the whole model on the torch path, a prefill kernel that fails keeps prompt chunks there, and
each says why in a warning."""

from __future__ import annotations

import importlib.util
import logging
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")


def check(monkeypatch, decode: str | None, prefill: str | None, device: str = "cuda"):
    from batcher.runtime import triton_attention, triton_prefill
    from batcher.runtime.model_runner import ModelRunner

    seen = []
    monkeypatch.setattr(triton_attention, "self_check", lambda *a: seen.append(a) or decode)
    monkeypatch.setattr(triton_prefill, "self_check", lambda *a: seen.append(a) or prefill)
    runner = object.__new__(ModelRunner)
    runner.backend = "triton"
    loaded = SimpleNamespace(device=torch.device(device), dtype=torch.bfloat16,
                             config=SimpleNamespace(num_heads=8, num_kv_heads=2, head_dim=64))
    return runner._check_triton_kernels(loaded, 16), runner.backend, seen


def test_both_kernels_pass_in_the_models_shapes(monkeypatch):
    uses_prefill, backend, seen = check(monkeypatch, None, None)
    assert (uses_prefill, backend) == (True, "triton")
    assert seen == [(torch.device("cuda"), torch.bfloat16, 8, 2, 64, 16)] * 2


def test_a_failing_decode_kernel_keeps_the_torch_path(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING):
        uses_prefill, backend, _ = check(monkeypatch, "RuntimeError: cannot compile", None)
    assert (uses_prefill, backend) == (False, "torch")
    assert "paged decode kernel failed its start-up check (RuntimeError" in caplog.text


def test_a_failing_prefill_kernel_keeps_prompt_chunks_on_torch(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING):
        uses_prefill, backend, _ = check(monkeypatch, None, "differs from torch attention")
    assert (uses_prefill, backend) == (False, "triton")
    assert "varlen prefill kernel failed its start-up check" in caplog.text


def test_nothing_is_checked_off_cuda(monkeypatch):
    assert check(monkeypatch, "x", "x", device="cpu") == (False, "triton", [])
